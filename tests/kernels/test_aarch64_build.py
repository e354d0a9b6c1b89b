"""Every C++ kernel file compiles for aarch64, the generic rung (the Armv8-A baseline: zig's
generic target) and the top one, neon_dotprod (Armv8.2-A's dot products; its macros
include neon's, whose paths it builds too), x86 intrinsics and asm only behind their ISA's
guards, cross-compiled with zig's clang (`pip install ziglang`: no Arm machine or cross
gcc needed). Slow (about 25 s a file and rung on 2 Zen 3 cores); skipped without zig.
tests/kernels/test_neon_strips.py runs the Arm strip passes in an emulator."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from kernels.build import HEADERS
from kernels.isa import rungs

pytest.importorskip("ziglang", reason="the aarch64 build check needs `pip install ziglang`")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    p.relative_to(ROOT) for p in ROOT.rglob("*.cpp") if not {".venv", "tests"} & set(p.parts)
)


def _openmp_include(folder: Path) -> list[str]:
    """zig's clang has no omp.h; gcc's declares the same portable API. Copied alone: gcc's
    include folder also holds its x86 intrinsics headers, which would shadow clang's."""
    found = subprocess.run(
        ["gcc", "-print-file-name=include/omp.h"], capture_output=True, text=True
    )
    path = Path(found.stdout.strip())
    if not path.is_file():
        return []
    folder.mkdir()
    shutil.copy(path, folder / "omp.h")
    return [f"-isystem{folder}"]


@pytest.mark.parametrize("rung", ["generic", "neon_dotprod"])
@pytest.mark.parametrize("source", SOURCES, ids=str)
def test_kernel_file_compiles_for_aarch64(tmp_path, source, rung):
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths("cpu"), sysconfig.get_path("include", "posix_prefix")]
    command = [
        sys.executable, "-m", "ziglang", "c++", "-target", "aarch64-linux-gnu",
        "-std=c++20", "-O1", "-fopenmp", "-c", "-o", str(tmp_path / "kernel.o"),
        "-DTORCH_EXTENSION_NAME=kernel", "-DTORCH_API_INCLUDE_EXTENSION_H", f"-I{HEADERS}",
        *(f"-isystem{path}" for path in includes), *_openmp_include(tmp_path / "omp"),
        *(["-mcpu=generic+dotprod"] if rung == "neon_dotprod" else []),
        *(f"-DSPLITSERVE_{r.upper()}" for r in rungs(rung, "aarch64")[1:]), str(ROOT / source),
    ]  # fmt: skip
    built = subprocess.run(command, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-4000:]
