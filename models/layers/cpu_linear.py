"""Small-batch bf16 linear layers on CPUs with AMX (cpu_linear.cpp).

A decode step of few requests multiplies a few rows by every weight, so reading the
weights is its cost; torch's bf16 matmul reads them at about a third of the memory
bandwidth. When the kernel set hands a layer the kernel (`PackedWeightMixin.bind_kernels`),
a weight the kernel takes (bf16, both sizes multiples of 32: the kernel says) gets a copy
in the kernel's tile layout, as much memory again as the weight. `linear` then runs
batches of up to SMALL_BATCH_ROWS rows through the kernel and anything else through
F.linear. Both accumulate in float32 and round once (bitwise equal up to 32 rows; beyond,
about 1 in 10^4 results differ by a rounding, as F.linear's own blocking changes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from kernels import KernelSet
from kernels.build import cpp_extension

# Up to here the kernel beats F.linear (measured on SmolLM2's weights with 2 threads; past
# it, F.linear's blocking wins: the kernel reads x once per 32 output features).
SMALL_BATCH_ROWS = 256
_EXTENSION = cpp_extension(
    "splitserve_cpu_linear", Path(__file__).with_name("cpu_linear.cpp"), only_on="amx"
)


def linear_kernel(kernels: KernelSet) -> ModuleType | None:
    """The compiled kernel where the set's ISA has AMX and this process may use it."""
    if not kernels.has("amx"):
        return None
    ops = kernels.cpp(_EXTENSION)
    return ops if ops is not None and ops.amx_usable() else None


@dataclass(frozen=True)
class PackedWeight:
    """A weight in the kernel's tile layout, with the kernel that reads it."""

    kernel: ModuleType
    data: torch.Tensor


def pack_weight(weight: torch.Tensor, kernels: KernelSet) -> PackedWeight | None:
    """`weight` packed for the set's kernel; None where there is none or it does not take
    the weight. The copy does not follow later changes to the weight: pack again."""
    kernel = linear_kernel(kernels)
    data = None if kernel is None else kernel.pack_weight(weight.detach())
    return None if data is None else PackedWeight(kernel, data)


class PackedWeightMixin:
    """A layer whose `weight` runs small batches through the kernel, once packed."""

    weight: torch.Tensor
    packed_weight: PackedWeight | None = None

    def bind_kernels(self, kernels: KernelSet) -> None:
        self.packed_weight = pack_weight(self.weight, kernels)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: PackedWeight | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias); through the kernel, given `weight` packed, for x of 1 to
    SMALL_BATCH_ROWS rows that it takes."""
    if packed is None or not 1 <= x.shape[0] <= SMALL_BATCH_ROWS:
        return F.linear(x, weight, bias)
    out = packed.kernel.linear(x, packed.data, bias)
    return F.linear(x, weight, bias) if out is None else out
