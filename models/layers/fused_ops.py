"""The fused kernels of the norm, activation and rotary layers, as the kernel set has them:
C++ on the CPU (cpu_ops.cpp), Triton on CUDA (triton_ops.py). Both have the same functions,
and each says whether it takes its tensors: `rms_norm` and `silu_and_mul` return None,
`add_rms_norm` and `rotary_embedding` (in place) return False, touching nothing, where it
does not. The layer then runs its torch code, the reference both match (the C++ kernels
bitwise)."""

from types import ModuleType

import models.layers.triton_ops as triton_ops
from kernels import KernelSet
from kernels.libraries import OPS


def fused_ops(kernels: KernelSet) -> ModuleType | None:
    """The fused kernels of a set made for the model's device, or None: torch code."""
    if kernels.cpu:
        return kernels.cpp(OPS)
    return triton_ops if kernels.triton else None
