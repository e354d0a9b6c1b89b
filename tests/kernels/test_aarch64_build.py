"""Every C++ kernel file compiles for aarch64, x86 intrinsics and asm only behind their
ISA's guards, cross-compiled with zig's clang (tests/kernels/aarch64_zig.py). The generic
rung (the Armv8-A baseline) runs in the default set, at -O0 on a precompiled torch_ext.h
(~1.5 s a file on a Zen 4 core); neon (Armv8.0's NEON) and neon_dotprod (Armv8.2-A's dot
products) at -O1 and marked slow: the NEON paths that matter are also built, and run, in
the default set by the emulator tests (test_neon_*.py). Skipped without zig."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest

from kernels.build import HEADERS
from tests.kernels.aarch64_zig import compile_command, run

pytest.importorskip("ziglang", reason="the aarch64 build check needs `pip install ziglang`")

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    p.relative_to(ROOT) for p in ROOT.rglob("*.cpp") if not {".venv", "tests"} & set(p.parts)
)
OPTIMIZATION = {"generic": "-O0", "neon": "-O1", "neon_dotprod": "-O1"}


def _openmp_include(folder: Path) -> list[str]:
    """zig's clang has no omp.h; gcc's declares the same portable API. Copied alone: gcc's
    include folder also holds its x86 intrinsics headers, which would shadow clang's."""
    found = subprocess.run(
        ["gcc", "-print-file-name=include/omp.h"], capture_output=True, text=True
    )
    path = Path(found.stdout.strip())
    if not path.is_file():
        return []
    folder.mkdir(exist_ok=True)
    shutil.copy(path, folder / "omp.h")
    return [f"-isystem{folder}"]


def _compile(folder: Path, rung: str, *args: str) -> None:
    python = sysconfig.get_path("include", "posix_prefix")
    run([*compile_command(rung), f"-isystem{python}", *_openmp_include(folder / "omp"),
         OPTIMIZATION[rung], "-fopenmp", "-DTORCH_EXTENSION_NAME=kernel",
         "-DTORCH_API_INCLUDE_EXTENSION_H", *args])  # fmt: skip


@pytest.fixture(scope="session")
def precompiled_header(tmp_path_factory) -> Callable[[str], Path]:
    """torch_ext.h precompiled for a rung, once per test process and rung: every kernel
    file includes it first, and parsing it is most of a file's time."""
    made: dict[str, Path] = {}

    def get(rung: str) -> Path:
        if rung not in made:
            folder = tmp_path_factory.mktemp(f"pch-{rung}")
            pch = folder / "torch_ext.h.pch"
            _compile(folder, rung, "-x", "c++-header", str(HEADERS / "torch_ext.h"), "-o", str(pch))
            made[rung] = pch
        return made[rung]

    return get


@pytest.mark.parametrize(
    "rung",
    ["generic", *(pytest.param(r, marks=pytest.mark.slow) for r in ("neon", "neon_dotprod"))],
)
@pytest.mark.parametrize("source", SOURCES, ids=str)
def test_kernel_file_compiles_for_aarch64(tmp_path, precompiled_header, source, rung):
    pch = precompiled_header(rung)
    _compile(tmp_path, rung, "-include-pch", str(pch), "-c", "-o", str(tmp_path / "kernel.o"),
             str(ROOT / source))  # fmt: skip
