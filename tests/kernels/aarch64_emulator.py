"""Arm kernels tested on any machine: C++ built for aarch64 with zig's clang (`pip install
ziglang`) as a static program without a C runtime, whose entry function unicorn's emulator
(`pip install unicorn`, QEMU's `max` CPU: NEON with the dot-product extension) calls on
arrays copied into its memory."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

unicorn = pytest.importorskip("unicorn", reason="Arm kernel tests need `pip install unicorn`")
pytest.importorskip("ziglang", reason="Arm kernel tests need `pip install ziglang`")
from unicorn import arm64_const as arm64  # noqa: E402

from kernels import KernelSet  # noqa: E402
from kernels.isa import machine, runnable_isas  # noqa: E402
from tests.kernels.aarch64_zig import ZIG, compile_command, run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

PAGE = 4096
STACK, STACK_BYTES = 0x7000_0000, 1 << 20
DATA = 0x4000_0000
RETURN = 0x7F00_0000  # the entry function returns here; emulation stops


def build(source: Path, out: Path, includes: list[Path], rung: str = "neon_dotprod") -> Path:
    """`source` compiled for an aarch64 rung (aarch64_zig.compile_command; includes: more
    header folders) and linked, without a C library, with `harness` as its entry symbol."""
    obj = out.with_suffix(".o")
    extra = [f"-I{p}" for p in includes]
    run([*compile_command(rung), *extra, "-O2", "-fno-pie", "-c", "-o", str(obj), str(source)])
    run([*ZIG, "ld.lld", "-static", "-e", "harness", str(obj), "-o", str(out)])
    return out


def program_of(
    harness: str, includes: list[str], folder: Path, rung: str = "neon_dotprod"
) -> Aarch64Program:
    """tests/kernels/<harness> built for `rung` (includes: folders of the repository) and
    loaded."""
    source = ROOT / "tests" / "kernels" / harness
    elf = build(source, folder / Path(harness).with_suffix(f".{rung}.elf").name,
                [ROOT / p for p in includes], rung)  # fmt: skip
    return Aarch64Program(elf.read_bytes())


def avx2_build(load: Callable[[KernelSet], ModuleType | None]) -> ModuleType | None:
    """load's module of the AVX2 build, the one the Arm paths match bitwise, where this
    machine runs it; else None."""
    if machine() != "x86_64" or "avx2" not in runnable_isas():
        return None
    module = load(KernelSet(cpu=True, isa="avx2"))
    assert module is not None, "the avx2 build failed"
    return module


def _align(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


class Aarch64Program:
    """A static aarch64 ELF program loaded into an emulator, its entry function callable
    with integer or pointer arguments; `put` copies arrays into the emulator's memory."""

    def __init__(self, elf: bytes, data_bytes: int = 64 << 20) -> None:
        self.uc = unicorn.Uc(unicorn.UC_ARCH_ARM64, unicorn.UC_MODE_ARM)
        self.uc.ctl_set_cpu_model(arm64.UC_CPU_ARM64_MAX)
        entry, phoff, phentsize, phnum = (
            struct.unpack_from("<Q", elf, 24)[0],
            struct.unpack_from("<Q", elf, 32)[0],
            struct.unpack_from("<H", elf, 54)[0],
            struct.unpack_from("<H", elf, 56)[0],
        )
        assert elf[:4] == b"\x7fELF" and elf[18] == 183, "not an aarch64 ELF file"
        for i in range(phnum):
            kind, _, offset, vaddr, _, filesz, memsz = struct.unpack_from(
                "<IIQQQQQ", elf, phoff + i * phentsize
            )
            if kind != 1:  # PT_LOAD
                continue
            start = vaddr // PAGE * PAGE
            self.uc.mem_map(start, _align(vaddr + memsz) - start)
            self.uc.mem_write(vaddr, elf[offset : offset + filesz])
        self.entry = entry
        self.uc.mem_map(STACK - STACK_BYTES, STACK_BYTES)
        self.uc.mem_map(RETURN, PAGE)
        self.uc.mem_map(DATA, data_bytes)
        self.data_end = DATA + data_bytes
        cpacr = self.uc.reg_read(arm64.UC_ARM64_REG_CPACR_EL1)
        self.uc.reg_write(arm64.UC_ARM64_REG_CPACR_EL1, cpacr | (3 << 20))  # FP and SIMD on
        self.free = DATA

    def put(self, array: np.ndarray) -> int:
        """A copy of `array` (C order) in the emulator's memory: its address."""
        data = np.ascontiguousarray(array).tobytes()
        at = self.free
        self.free = _align(at + len(data), 64)
        assert self.free <= self.data_end, "the emulator's data memory is full"
        self.uc.mem_write(at, data)
        return at

    def get(self, address: int, dtype: np.dtype, count: int) -> np.ndarray:
        size = np.dtype(dtype).itemsize * count
        return np.frombuffer(bytes(self.uc.mem_read(address, size)), dtype=dtype).copy()

    def clear(self) -> None:
        """Forget every array put (the memory is reused)."""
        self.free = DATA

    def call(self, *args: int) -> None:
        """The entry function called with `args` in x0, x1, ...."""
        assert len(args) <= 8
        for i, value in enumerate(args):
            self.uc.reg_write(arm64.UC_ARM64_REG_X0 + i, value)
        self.uc.reg_write(arm64.UC_ARM64_REG_SP, STACK - 64)
        self.uc.reg_write(arm64.UC_ARM64_REG_LR, RETURN)
        self.uc.emu_start(self.entry, RETURN)
