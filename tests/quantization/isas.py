"""The ISA rungs the quantized-kernel tests build: generic, avx2 and this machine's own.
Each build costs CI about half a minute; the rungs between are the own rung of other CI
machines (AVX-512 bf16 on Zen 4), where they are tested."""

from kernels.isa import ladder, probe_isa


def tested_isas() -> list[str]:
    rungs = ladder()
    own = probe_isa()
    return [r for r in rungs[: rungs.index(own) + 1] if r in ("generic", "avx2", own)]
