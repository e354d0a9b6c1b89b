"""The instruction set the C++ CPU kernels are built for: this CPU's best, or a lower one
forced with SPLITSERVE_CPU_ISA, so that every path can be built and tested on one machine.

The ISAs of an architecture form a ladder, each including the ones below it. x86: generic
(the x86-64 baseline), avx2 (x86-64-v3), avx512 (x86-64-v4), avx512_bf16, amx (AMX-BF16
tiles), and one side branch above avx2: avx2_vnni (AVX-VNNI, VNNI's int8 dot products on
256-bit registers: Alder Lake and later Intel cores without AVX-512, Zen 5), which the
avx512 rungs do not include (Skylake-X, Ice Lake and Zen 4 lack it). Arm: generic, neon
(the Armv8-A baseline has NEON, so both build alike; neon only names it), neon_dotprod
(Armv8.2-A's int8 dot products, `sdot`: Cortex-A76/Neoverse N1 and later, Apple M1 and
later; Graviton 2 and up). A build for an
ISA passes the compiler flags of the rungs it includes and defines SPLITSERVE_<RUNG> for
each non-generic one; the C++ keys its paths on those macros alone (kernels/cpu_math.h
checks they agree with the compiler's).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from functools import cache
from pathlib import Path

import torch

X86 = ("generic", "avx2", "avx2_vnni", "avx512", "avx512_bf16", "amx")  # worst to best
ARM = ("generic", "neon", "neon_dotprod")
# The rung each x86 rung stands on.
_X86_BELOW = {
    "avx2": "generic",
    "avx2_vnni": "avx2",
    "avx512": "avx2",
    "avx512_bf16": "avx512",
    "amx": "avx512_bf16",
}
# The /proc/cpuinfo flags each rung needs besides those of the rungs below it.
_X86_NEEDS = {
    "avx2": {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm", "xsave"}
    | {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"},
    "avx2_vnni": {"avx_vnni"},
    "avx512": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
    "avx512_bf16": {"avx512_bf16", "avx512_vnni"},  # every CPU with BF16 has VNNI
    "amx": {"amx_tile", "amx_bf16"},
}
# The compiler flags of each rung besides those of the rungs below it (avx2 and avx512 are
# x86-64-v3 and -v4, spelled out for compilers that do not know those names).
_X86_FLAGS = {
    "generic": ["-march=x86-64"],
    "avx2": ["-mavx", "-mavx2", "-mfma", "-mbmi", "-mbmi2", "-mf16c", "-mmovbe", "-mlzcnt"]
    + ["-mxsave", "-mcx16", "-msahf", "-mpopcnt", "-msse4.1", "-msse4.2", "-mssse3"],
    "avx2_vnni": ["-mavxvnni"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512cd", "-mavx512dq", "-mavx512vl"],
    "avx512_bf16": ["-mavx512bf16", "-mavx512vnni"],
    "amx": ["-mamx-tile", "-mamx-bf16"],
}
# torch's dispatch level, where /proc/cpuinfo cannot be read.
_TORCH_CAPABILITY = {"AVX2": "avx2", "AVX512": "avx512"}


def machine() -> str:
    name = platform.machine().lower()
    if name in ("x86_64", "amd64"):
        return "x86_64"
    return "aarch64" if name in ("aarch64", "arm64") else name


def ladder(arch: str | None = None) -> tuple[str, ...]:
    """The ISAs kernels can be built for on `arch` (default: this machine), lowest first."""
    arch = arch or machine()
    if arch == "x86_64":
        return X86
    return ARM if arch == "aarch64" else ("generic",)


def rungs(isa: str, arch: str | None = None) -> tuple[str, ...]:
    """The rungs `isa` includes, lowest first, itself last."""
    arch = arch or machine()
    if arch != "x86_64":
        own = ladder(arch)
        return own[: own.index(isa) + 1]
    path = [isa]
    while path[-1] in _X86_BELOW:
        path.append(_X86_BELOW[path[-1]])
    return tuple(reversed(path))


def includes(isa: str, rung: str) -> bool:
    """Whether `isa` includes the ladder's `rung` (e.g. "amx")."""
    return rung in rungs(isa)


@cache
def _cpuinfo() -> dict[str, str]:
    """The first CPU's /proc/cpuinfo fields, keys lowercased; empty where unreadable."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    return fields


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (x86 `flags`, Arm `Features`); empty where unreadable."""
    info = _cpuinfo()
    return frozenset(info.get("flags", info.get("features", "")).split())


def cpu_vendor() -> str:
    """The CPU's x86 vendor ("GenuineIntel", "AuthenticAMD"); empty elsewhere."""
    return _cpuinfo().get("vendor_id", "")


def probe_isa(flags: frozenset[str] | None = None, arch: str | None = None) -> str:
    """The highest ISA of the ladder that the CPU (its `flags`) has."""
    arch = arch or machine()
    flags = cpu_flags() if flags is None else flags
    if arch == "aarch64":
        return "neon_dotprod" if "asimddp" in flags else "neon"
    if arch != "x86_64":
        return "generic"
    if not flags:
        return _TORCH_CAPABILITY.get(str(torch.backends.cpu.get_cpu_capability()), "generic")
    return _runnable(flags)[-1]


def _runnable(flags: frozenset[str]) -> tuple[str, ...]:
    """The x86 rungs a CPU with `flags` runs: those whose rungs' flags it all has."""
    return tuple(
        isa for isa in X86 if all(_X86_NEEDS[rung] <= flags for rung in rungs(isa, "x86_64")[1:])
    )


def runnable_isas(native: str | None = None) -> tuple[str, ...]:
    """The ISAs this CPU runs kernels of, worst to best: the rungs its `native` ISA includes
    (default: the probed one), and on x86 a side branch whose flags it has."""
    if native is not None or machine() != "x86_64" or not cpu_flags():
        return rungs(native or probe_isa())
    return _runnable(cpu_flags())


def check_isa(isa: str, native: str | None = None) -> str:
    """`isa`, when this CPU can run kernels built for it (runnable_isas), else a ValueError
    that says which ISAs it can."""
    if isa not in ladder():
        raise ValueError(
            f"CPU ISA {isa!r} is not one of this {machine()} machine's: {', '.join(ladder())}"
        )
    allowed = runnable_isas(native)
    if isa not in allowed:
        raise ValueError(
            f"CPU ISA {isa!r} is not one this CPU ({allowed[-1]!r}) runs; "
            f"SPLITSERVE_CPU_ISA may only force one it runs: {', '.join(allowed)}"
        )
    return isa


def compiler_flags(isa: str) -> list[str]:
    """The flags that build kernels for `isa`: those of its rungs, -mtune=native (tuning
    only, so the build still runs on any CPU with the ISA) and its SPLITSERVE_<RUNG>
    macros."""
    included = rungs(isa)
    macros = [f"-DSPLITSERVE_{rung.upper()}" for rung in included[1:]]
    if machine() == "x86_64":
        return [flag for rung in included for flag in _X86_FLAGS[rung]] + ["-mtune=native", *macros]
    if machine() == "aarch64":
        march = "armv8.2-a+dotprod" if "neon_dotprod" in included else "armv8-a"
        return [f"-march={march}", *macros]
    return macros


def forced_isa(environ: Mapping[str, str] = os.environ) -> str:
    """The ISA SPLITSERVE_CPU_ISA forces, as written (lower case); "" where it is unset."""
    return environ.get("SPLITSERVE_CPU_ISA", "").strip().lower()


def has_native_bf16() -> bool:
    """Whether the CPU computes in bf16 natively (AVX512-BF16 or AMX-BF16, or Arm BF16): a
    float32 checkpoint then runs in bf16 by default. With SPLITSERVE_CPU_ISA forced, the
    answer is the forced rung's (on Arm, none has bf16), as on a CPU of that ISA."""
    forced = forced_isa()
    if machine() == "aarch64":
        return not forced and "bf16" in cpu_flags()
    return includes(check_isa(forced) if forced else probe_isa(), "avx512_bf16")
