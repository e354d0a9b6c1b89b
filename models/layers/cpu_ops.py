"""The fused CPU kernels of models/layers (cpu_ops.cpp: RMSNorm with the residual add,
rotary embedding, SiLU-and-mul), compiled on first use and cached.

`cpu_kernels(device, dtype)` is the compiled module for CPU tensors of float32, bfloat16
or float16 when it can be had (a C++ compiler, SPLITSERVE_CPU_KERNELS not 0), else None:
the layers then run their torch code, which is also the reference the kernels match
bitwise.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from attention.cpp_extension import load_cpp_extension

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SOURCE = Path(__file__).with_name("cpu_ops.cpp")


def cpu_kernels(device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    if device.type != "cpu" or dtype not in DTYPES:
        return None
    return load_cpp_extension("splitserve_cpu_ops", _SOURCE)


def fits_rows(x: torch.Tensor) -> bool:
    """Whether the kernels take x as rows: 1 to 3 dimensions, the last one contiguous."""
    return 1 <= x.dim() <= 3 and x.stride(-1) == 1
