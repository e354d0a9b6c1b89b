"""The ISA rungs the quantized-kernel tests build: generic, AVX2 (the strip kernels, what
every AVX2 CPU runs the default Q4_1 model on), AVX-VNNI where the CPU has it (the strips'
VNNI path on 16 registers; Intel CI machines have it beside AMX) and this machine's own.
Each build costs CI about half a minute; the other rungs between are the own rung of other
CI machines (AVX-512 bf16 on Zen 4, AMX on Sapphire Rapids), tested there."""

from kernels.isa import probe_isa, runnable_isas


def kernel_isas() -> list[str]:
    own = probe_isa()
    return [r for r in runnable_isas() if r in ("generic", "avx2", "avx2_vnni", own)]
