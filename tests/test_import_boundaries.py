"""DESIGN §2: what each package must not import, checked on the source (every import
statement, those inside functions included) and, for the worker and server processes, on
what they load at run time."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.import_graph import ROOT, imports, module_name

PACKAGES = (
    "kv_cache",
    "engine_core",
    "ipc",
    "worker",
    "attention",
    "kernels",
    "models",
    "server",
    "splitserve",
)
OTHERS = {*PACKAGES, "launch"}  # a package's imports of itself are left out below
FORBIDDEN: dict[str, set[str]] = {
    "kv_cache": {"torch", *OTHERS},
    "engine_core": {"torch", "worker", "models", "attention", "server"},
    "ipc": {"torch", *OTHERS},
    "worker": {"engine_core", "kv_cache", "server"},
    "attention": {"worker", "engine_core", "models"},
    "kernels": OTHERS,
    "models": {"engine_core", "kv_cache", "worker"},
    "server": {"torch", "worker", "models", "kv_cache"},
    "splitserve": set(),
}


def violations(root: Path = ROOT) -> list[str]:
    found = []
    for package in PACKAGES:
        forbidden = FORBIDDEN[package] - {package}
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for found_import in imports(tree, *module_name(path, root), type_checking=True):
                module = found_import.module.split(".")[0]
                if module in forbidden:
                    where = f"{path.relative_to(root)}:{found_import.line}"
                    found.append(f"{where}: {package} imports {module}")
    return found


def test_packages_import_only_what_design_allows():
    found = violations()
    assert not found, "imports DESIGN §2 forbids:\n" + "\n".join(found)


def test_the_check_sees_imports_inside_functions(tmp_path):
    (tmp_path / "ipc").mkdir()
    (tmp_path / "ipc" / "bad.py").write_text(
        "from . import fine\n\ndef f():\n    import torch\n    from engine_core.core import X\n"
    )
    for package in PACKAGES[:2] + PACKAGES[3:]:
        (tmp_path / package).mkdir()
    assert violations(tmp_path) == [
        "ipc/bad.py:4: ipc imports torch",
        "ipc/bad.py:5: ipc imports engine_core",
    ]


def _loaded_packages(code: str) -> set[str]:
    probe = f"{code}; import sys; print(sorted({{m.split('.')[0] for m in sys.modules}}))"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return set(ast.literal_eval(result.stdout.strip()))


def test_a_worker_process_loads_no_engine_side_package():
    loaded = _loaded_packages("import launch, splitserve.roles, worker.worker_main")
    assert loaded & {"engine_core", "kv_cache"} == set()


def test_the_server_loads_none_of_the_engine_side_packages():
    loaded = _loaded_packages("import server, server.cli")
    assert loaded & {"torch", "transformers", "worker", "models", "attention", "kv_cache"} == set()
