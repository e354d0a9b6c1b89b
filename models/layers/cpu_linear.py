"""Small-batch bf16 linear layers on CPUs with AMX (cpu_linear.cpp).

A decode step of few requests multiplies a few rows by every weight, so reading the
weights is its cost; torch's bf16 matmul reads them at about a third of the memory
bandwidth here (SmolLM2's 268 MB of weights against 1 to 32 rows: 22-26 ms; the kernel
10-12 ms). `pack_linear_weights(model)` gives every layer with a `packed_weight`
attribute whose weight fits (bf16, both sizes multiples of 32) a copy of it in the
kernel's tile layout, as much memory again as those weights. `linear` then runs batches
of up to SMALL_BATCH_ROWS rows through the kernel and anything else through F.linear.
Both accumulate in float32 and round once (bitwise equal up to 32 rows here; beyond,
about 1 in 10^4 results differ by a rounding, as F.linear's own blocking changes).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from attention.cpp_extension import load_cpp_extension

# Up to here the kernel beats F.linear (measured, SmolLM2's weights, 2 threads: 2.3x at
# 1 row, 2.0x at 64, 1.7x at 128, 1.1x at 256; 0.7x at 2048, where it reads x once per 32
# output features).
SMALL_BATCH_ROWS = 256
_SOURCE = Path(__file__).with_name("cpu_linear.cpp")


def linear_kernels() -> ModuleType | None:
    """The compiled kernels when this CPU and process may use AMX, else None."""
    ops = load_cpp_extension("splitserve_cpu_linear", _SOURCE)
    return ops if ops is not None and ops.amx_usable() else None


def pack_linear_weights(model: nn.Module) -> int:
    """Pack the weight of every module with a `packed_weight` attribute that the kernel
    takes (bf16 on the CPU, both sizes multiples of 32); returns how many it packed. The
    packed copies do not follow later changes to the weights: pack again after any."""
    modules = [m for m in model.modules() if hasattr(m, "packed_weight") and _fits(m.weight)]
    ops = linear_kernels() if modules else None
    if ops is None:
        return 0
    for module in modules:
        module.packed_weight = ops.pack_weight(module.weight.detach())
    return len(modules)


def _fits(w: torch.Tensor) -> bool:
    return (
        w.device.type == "cpu"
        and w.dtype == torch.bfloat16
        and w.dim() == 2
        and w.shape[0] % 32 == 0
        and w.shape[1] % 32 == 0
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias), through the AMX kernel when `packed_weight` (weight
    packed by pack_linear_weights) is given, x is 1 to SMALL_BATCH_ROWS dense rows and
    the kernels are on (SPLITSERVE_CPU_KERNELS)."""
    rows = x.shape[0]
    if (
        packed_weight is None
        or x.dim() != 2
        or not 1 <= rows <= SMALL_BATCH_ROWS
        or x.stride(-1) != 1
        or x.dtype != torch.bfloat16
    ):
        return F.linear(x, weight, bias)
    ops = linear_kernels()
    return F.linear(x, weight, bias) if ops is None else ops.linear(x, packed_weight, bias)
