"""torch's headers precompiled once per ISA (kernels/build.py): every kernel file includes
torch_ext.h first (gcc uses a precompiled header only there) and sits in another folder,
and the header made for this machine's ISA is one gcc takes."""

import fcntl
import subprocess
import time
from pathlib import Path

from kernels.build import CFLAGS, HEADERS, _header_folder, _precompiled_header
from kernels.isa import compiler_flags, probe_isa

ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_file_includes_torch_ext_first():
    files = subprocess.run(
        ["git", "ls-files", "*.cpp"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert files
    for name in files:
        if name.startswith("tests/"):  # the emulator tests' programs: built for Arm, no torch
            continue
        lines = (ROOT / name).read_text().splitlines()
        first = next(line for line in lines if line.startswith("#include"))
        assert first == '#include "torch_ext.h"', name
        # gcc looks for a quoted header beside the file first: one there misses the .gch
        assert (ROOT / name).parent != HEADERS, f"{name} sits beside torch_ext.h"


def test_the_precompiled_header_is_usable_here():
    isa = probe_isa()
    folder = _precompiled_header(isa, tuple(CFLAGS + compiler_flags(isa)))
    assert folder is not None
    assert (folder / "torch_ext.h.gch").stat().st_size > 0


def test_a_build_does_not_wait_for_a_header_another_is_making(tmp_path, monkeypatch):
    """While one process holds the header's lock (making it), another's call returns at
    once, with no .gch: its builds parse the header copy, the same command line."""
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path))
    flags = ("-O1", "-DSPLITSERVE_TEST_HEADER")
    folder = _header_folder("generic", flags)
    assert (folder / "torch_ext.h").read_bytes() == (ROOT / "kernels/torch_ext.h").read_bytes()
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        start = time.monotonic()
        assert _precompiled_header("generic", flags) is None
        assert time.monotonic() - start < 5
    assert not (folder / "torch_ext.h.gch").exists()
