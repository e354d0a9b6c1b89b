"""The ISA rungs the quantized-kernel tests build: generic, AVX2 (the strip kernels, what
every AVX2 CPU runs the default Q4_1 model on) and this machine's own. Each build costs CI
about half a minute; the other rungs between are the own rung of other CI machines
(AVX-512 bf16 on Zen 4, AMX on Sapphire Rapids), tested there."""

from kernels.isa import ladder, probe_isa


def kernel_isas() -> list[str]:
    rungs = ladder()
    own = probe_isa()
    return [r for r in rungs[: rungs.index(own) + 1] if r in ("generic", "avx2", own)]
