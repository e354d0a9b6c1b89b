"""The compiled kernels' build, the CPU ISA probe and the KernelSet a model runs with."""

from kernels.isa import check_isa, has_native_bf16, probe_isa
from kernels.kernel_set import KernelSet

__all__ = ["KernelSet", "check_isa", "has_native_bf16", "probe_isa"]
