"""Dense linear layers on CPU through C++: bf16 small batches on AMX tiles (cpu_linear.cpp),
and float32 math on bf16 or float32 weights where the CPU has no bf16 instructions
(cpu_dense_linear.cpp).

A decode step of few requests multiplies a few rows by every weight, so reading the
weights is its cost; torch's bf16 matmul reads them at about a third of the memory
bandwidth. When the kernel set hands a layer the kernel (`PackedWeightMixin.bind_kernels`),
a weight the kernel takes (bf16, both sizes multiples of 32: the kernel says) gets a copy
in the kernel's tile layout, as much memory again as the weight. `linear` then runs
batches of up to SMALL_BATCH_ROWS rows through the kernel and anything else through
F.linear. Both accumulate in float32 and round once (bitwise equal up to 32 rows; beyond,
about 1 in 10^4 results differ by a rounding, as F.linear's own blocking changes).

Without AVX512-BF16 (AVX2, AVX-512F, Arm) torch's bf16 matmul has no instructions to run
on (a third of its float32 speed on a Zen 1), so there a bf16 weight is computed on by the
dense kernel, widened in registers, for any rows and float32 or bf16 x. That is what lets a
float32 model keep its dense weights in bf16 (loader.dense_weight_dtype): half the bytes a
decode step reads, float32 math. The same kernel takes float32 weights, where it beats
torch's GEMM at every row count (prefills too: cpu_gemm.h). Either gets a copy in the
GEMM's panels, in its own dtype (as much memory again as those weights, as the AMX copy),
which every row count streams in order; a weight whose rows are not a multiple of the panel
width stays as it is. All these copies are made on huge pages (kernels/huge_pages.py),
streamed every decode step.

With AVX-512 BF16 but no AMX (Zen 4, Cooper Lake), bf16 layers run batches of up to 64
rows through cpu_bf16_linear.cpp (`vdpbf16ps` on the weight as it is, no copy; 2.2x
F.linear at one row on 2 Zen 4 cores), F.linear beyond: the same `dense_linear` function
and PackedWeight as the float32-math kernel. Float32 weights (`--dtype float32`) take the
float32-math kernel on every CPU, AMX ones too (on 2 Zen 4 cores, SmolLM2's weights: 2.1x
F.linear at 1 row, 2.0x at 64; prefill steps of 2048 tokens 25 % faster); on Intel CPUs,
where torch's float32 matmul is MKL's own code, only up to FLOAT32_GEMM_ROWS rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from kernels import KernelSet
from kernels.huge_pages import copy_to_huge_pages
from kernels.libraries import AMX_LINEAR, BF16_LINEAR, DENSE_LINEAR

# Up to here the kernel beats F.linear (measured on SmolLM2's weights with 2 threads; past
# it, F.linear's blocking wins: the kernel reads x once per 32 output features).
SMALL_BATCH_ROWS = 256
# Float32 weights from here on take F.linear where the set has no float32_gemm (Intel CPUs):
# MKL's own float32 matmul there is level with the kernel from 768 rows on (0.98-1.02x at
# 768-2048), which is 24 % faster at 192 rows and more at fewer (SmolLM2's weights, 2
# Emerald Rapids cores; the kernel's tiles prefetching their panels).
FLOAT32_GEMM_ROWS = 768


def linear_kernel(kernels: KernelSet) -> ModuleType | None:
    """The compiled kernel where the set's ISA has AMX and this process may use it."""
    if not kernels.has("amx"):
        return None
    ops = kernels.cpp(AMX_LINEAR)
    return ops if ops is not None and ops.amx_usable() else None


def bf16_linear_kernel(kernels: KernelSet) -> ModuleType | None:
    """The bf16 kernel of few rows, where the set's ISA has AVX-512 BF16 but not AMX: the
    same `dense_linear` as the float32-math kernel's, for bf16 x and W."""
    return kernels.cpp(BF16_LINEAR)


def dense_linear_kernel(kernels: KernelSet) -> ModuleType | None:
    """The float32-math kernel: on float32 weights on any CPU, on bf16 weights where the
    set's ISA has no bf16 instructions."""
    return kernels.cpp(DENSE_LINEAR)


@dataclass(frozen=True)
class PackedWeight:
    """A weight as a C++ kernel reads it: a copy in the AMX tile layout (`amx`), a float32
    weight's copy in the dense kernel's panels, or the weight itself for the dense kernel."""

    kernel: ModuleType
    data: torch.Tensor
    amx: bool = True
    max_rows: int | None = None  # None: any

    @property
    def row_limit(self) -> int | None:
        """The most rows the kernel is given (F.linear past it); None: any."""
        return SMALL_BATCH_ROWS if self.amx else self.max_rows

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """x W^T (+ bias), or None where the kernel does not take x."""
        limit = self.row_limit
        if limit is not None and x.shape[0] > limit:
            return None
        if not self.amx:
            return self.kernel.dense_linear(x, self.data, bias)
        return self.kernel.linear(x, self.data, bias)


def pack_weight(weight: torch.Tensor, kernels: KernelSet) -> PackedWeight | None:
    """`weight` prepared for the set's kernel; None where there is none or it does not
    take the weight. An AMX copy does not follow later changes to the weight: pack again."""
    kernel = linear_kernel(kernels)
    if kernel is not None and weight.dtype == torch.bfloat16:
        data = kernel.pack_weight(weight.detach())
        return None if data is None else PackedWeight(kernel, copy_to_huge_pages(data))
    if weight.dtype not in (torch.bfloat16, torch.float32) or weight.device.type != "cpu":
        return None
    if weight.dtype == torch.bfloat16 and kernels.has("avx512_bf16"):
        bf16 = bf16_linear_kernel(kernels)
        return None if bf16 is None else PackedWeight(bf16, weight.detach(), amx=False)
    dense = dense_linear_kernel(kernels)
    if dense is None:
        return None
    weight = weight.detach()
    panels = dense.pack_weight_panels(weight)  # None but for weights of some shapes
    any_rows = kernels.float32_gemm or weight.dtype != torch.float32
    data = weight if panels is None else copy_to_huge_pages(panels)
    return PackedWeight(dense, data, amx=False, max_rows=None if any_rows else FLOAT32_GEMM_ROWS)


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
    """F.linear(x, weight, bias) in x's dtype; through the kernel, given `weight` packed,
    for x that it takes (a weight held in another dtype than x's is widened for F.linear)."""
    out = None if packed is None else packed(x, bias)
    if out is not None:
        return out
    return F.linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype), bias)
