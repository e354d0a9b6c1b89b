"""Tests share code through helper modules and fixtures: no file under tests/ imports a
test module or a conftest (importing a test module collects its tests a second time, on
fixtures they were not written for)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.import_graph import ROOT, imports, module_name


def _is_test_module(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def test_module_imports(root: Path = ROOT) -> list[str]:
    """`path:line: module` of every import of a test module or a conftest under root/tests."""
    found = []
    for path in sorted((root / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for imported in imports(tree, *module_name(path, root), type_checking=True):
            names = [imported.module]
            if (root / imported.module.replace(".", "/")).is_dir():  # `from package import m`
                names += [f"{imported.module}.{name}" for name in imported.names]
            where = f"{path.relative_to(root)}:{imported.line}"
            found += [f"{where}: {name}" for name in names if _is_test_module(name)]
    return found


test_module_imports.__test__ = False  # a helper, not a test


def test_no_test_imports_a_test_module_or_a_conftest():
    found = test_module_imports()
    assert not found, "imports of test modules:\n" + "\n".join(found)


def test_the_check_sees_every_form_of_import(tmp_path):
    folder = tmp_path / "tests" / "area"
    folder.mkdir(parents=True)
    (folder / "helpers.py").write_text("def test_like_name():\n    pass\n")
    (folder / "test_b.py").write_text("")
    (folder / "test_a.py").write_text(
        "from tests.area.test_b import x\n"
        "from conftest import fixture\n"
        "from tests.area import helpers, test_b\n"
        "from tests.area.helpers import test_like_name\n"
        "def f():\n    import test_b\n"
    )
    assert test_module_imports(tmp_path) == [
        "tests/area/test_a.py:1: tests.area.test_b",
        "tests/area/test_a.py:2: conftest",
        "tests/area/test_a.py:3: tests.area.test_b",
        "tests/area/test_a.py:6: test_b",
    ]
