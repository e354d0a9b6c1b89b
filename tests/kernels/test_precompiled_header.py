"""torch's headers precompiled once per ISA (kernels/build.py): every kernel file includes
torch_ext.h first (gcc uses a precompiled header only there), and the header made for this
machine's ISA is one gcc takes."""

import subprocess
from pathlib import Path

from kernels.build import CFLAGS, _precompiled_header
from kernels.isa import compiler_flags, probe_isa

ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_file_includes_torch_ext_first():
    files = subprocess.run(
        ["git", "ls-files", "*.cpp"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert files
    for name in files:
        lines = (ROOT / name).read_text().splitlines()
        first = next(line for line in lines if line.startswith("#include"))
        assert first == '#include "torch_ext.h"', name


def test_the_precompiled_header_is_usable_here():
    isa = probe_isa()
    folder = _precompiled_header(isa, tuple(CFLAGS + compiler_flags(isa)))
    assert folder is not None
    assert (folder / "torch_ext.h.gch").stat().st_size > 0
