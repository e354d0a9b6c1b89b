"""C++ compiled for an aarch64 rung with zig's clang (`pip install ziglang`: no Arm machine
or cross gcc needed), for tests/kernels/test_aarch64_build.py and aarch64_emulator.py."""

from __future__ import annotations

import subprocess
import sys

from kernels.build import HEADERS
from kernels.isa import rungs

ZIG = [sys.executable, "-m", "ziglang"]


def compile_command(rung: str) -> list[str]:
    """zig's c++ for aarch64 at `rung` (its -mcpu and SPLITSERVE_<RUNG> macros), C++20,
    kernels/ and torch's headers on the include path; the caller adds the rest."""
    from torch.utils import cpp_extension

    cpu = "-mcpu=generic+dotprod" if rung == "neon_dotprod" else "-mcpu=generic"
    return [
        *ZIG, "c++", "-target", "aarch64-linux-gnu", cpu, "-std=c++20",
        *(f"-DSPLITSERVE_{r.upper()}" for r in rungs(rung, "aarch64")[1:]), f"-I{HEADERS}",
        *(f"-isystem{p}" for p in cpp_extension.include_paths("cpu")),
    ]  # fmt: skip


def run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
