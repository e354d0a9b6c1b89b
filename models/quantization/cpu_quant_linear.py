"""Linear layers on block-quantized weights on the CPU (cpu_quant_linear.cpp), on CUDA
through the Triton matmul (triton_quant_linear.py), and the torch fallback that
dequantizes per call.

`prepare_quant_weight` runs once at load: the weight stays quantized (made contiguous,
which copies only a narrowed shard; on AVX2 builds regrouped into strips of 8 output
features, models/quantization/strips.py, the one copy kept; AVX512-BF16 builds without AMX
and NEON builds on Arm too). `quant_linear` then picks by
x's dtype and rows. By default x of any float dtype is quantized to int8 per 32 features
for integer dot products (what llama.cpp and vLLM's GGUF kernels do), up to INT8_ROWS rows
(decode); bfloat16 x of TILE_ROWS rows, where the build has AMX or AVX512-BF16, takes the
bf16 tiles instead (the weight dequantized to bf16 in registers and multiplied there:
F.linear on w.dequantize(torch.bfloat16) in float32, rounded once); more rows (prefill):
the weight dequantized in the C++ to x's dtype for torch's matmul. With the kernel set's
int8_activations off (SPLITSERVE_INT8_ACTIVATIONS=0), float32 x of up to EXACT_ROWS rows
takes the exact path instead (the weight dequantized in registers, float32 products:
F.linear(x, w.dequantize()) up to the order of the sums). A weight in strips takes the
strip kernels: int8 at any rows (bfloat16 x up to STRIP_INT8_ROWS_BF16 where torch's bf16
matmul is native); float32 x, when exact, up to STRIP_EXACT_ROWS (an LM head:
STRIP_EXACT_ROWS_HEAD), else dequantizing.
Whatever the C++ does not take runs `torch_quant_linear`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from kernels import KernelSet
from kernels.libraries import QUANT_LINEAR
from models.quantization.block_quant import BlockQuantWeight
from models.quantization.strips import StripQuantWeight, to_strips
from models.quantization.triton_quant_linear import triton_quant_linear

# Up to these rows the kernels beat dequantizing for torch's matmul (measured on
# SmolLM2-135M's shapes, one thread's CPU time, with AMX: benchmarks/quant_linear_bench.py).
EXACT_ROWS = 16
INT8_ROWS = 16
# From here the bf16 tile kernel beats the int8 path, and up to here dequantizing for
# torch's matmul (same measurements, 1 and 2 threads).
TILE_ROWS = range(6, 129)
# The exact path on strips beats dequantizing for torch's float32 matmul up to these rows:
# 32 for the layers of a decoder, 128 for an LM head (more than 16384 rows), whose
# dequantized copy costs most (AVX2 strip kernels, AMD EPYC Zen 3, 2 threads). The int8
# strip kernel runs at any rows: the CPUs that get strips have no bf16 matmul, and it
# measured 8-10x faster than dequantizing for bf16 F.linear at 64 and 256 rows, and faster
# than float32 F.linear up to at least 128.
STRIP_EXACT_ROWS = 32
STRIP_EXACT_ROWS_HEAD = 128
HEAD_ROWS = 16384
# AVX512-BF16 CPUs compute on strips too (their VNNI int8 kernel beat the row kernels 1.4-2x
# at 1 row and 2.5-3.6x at 5-128, AMD EPYC Zen 4) and have a native bf16 matmul: bf16 x of
# more rows than this dequantizes for it (crossover 192-384 rows on SmolLM2-135M's shapes).
STRIP_INT8_ROWS_BF16 = 256


def quant_kernel(kernels: KernelSet) -> ModuleType | None:
    """The compiled kernels for the set's ISA; None where they are off or cannot be built."""
    return kernels.cpp(QUANT_LINEAR)


@dataclass(frozen=True)
class PreparedQuantWeight:
    """A quantized weight as the layer keeps it (in rows, or in strips where the kernel
    computes on strips), with the kernel that reads it (None: the torch fallback)."""

    weight: BlockQuantWeight | StripQuantWeight
    kernel: ModuleType | None
    triton: bool = False  # a CUDA weight the Triton matmul computes on
    exact_float32: bool = False  # float32 x takes float products, not int8 activations
    bf16_matmul: bool = False  # torch's bf16 matmul is native: many bf16 rows dequantize

    def strip_int8_rows(self, dtype: torch.dtype) -> int | None:
        """The most rows of x of `dtype` the int8 strip kernel takes (None: any)."""
        return STRIP_INT8_ROWS_BF16 if self.bf16_matmul and dtype == torch.bfloat16 else None

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    def row_weight(self) -> BlockQuantWeight:
        """The weight in the row layout (a copy when it is held in strips)."""
        w = self.weight
        return w.row_weight() if isinstance(w, StripQuantWeight) else w

    def rows(self, ids: torch.Tensor) -> BlockQuantWeight:
        """Rows `ids` (1-D), for embedding lookups."""
        w = self.weight
        if isinstance(w, StripQuantWeight):
            return w.rows(ids)
        mins = None if w.mins is None else w.mins[ids]
        return BlockQuantWeight(w.bits, w.qweight[ids], w.scales[ids], mins, w.block_size)


def prepare_quant_weight(
    w: BlockQuantWeight | PreparedQuantWeight, kernels: KernelSet
) -> PreparedQuantWeight:
    """w for the set's kernels; a prepared weight is prepared again from its rows."""
    if isinstance(w, PreparedQuantWeight):
        w = w.row_weight()
    if w.qweight.device.type == "cuda":
        return PreparedQuantWeight(w, None, triton=kernels.triton)
    kernel = quant_kernel(kernels)
    if kernel is None or w.qweight.device.type != "cpu":
        return PreparedQuantWeight(w, None)
    exact = not kernels.int8_activations
    strips = to_strips(w) if kernel.strip_width() else None
    if strips is not None:
        bf16_matmul = kernels.isa in ("avx512_bf16", "amx")
        return PreparedQuantWeight(strips, kernel, exact_float32=exact, bf16_matmul=bf16_matmul)
    mins = None if w.mins is None else w.mins.contiguous()
    dense = BlockQuantWeight(
        w.bits, w.qweight.contiguous(), w.scales.contiguous(), mins, w.block_size
    )
    return PreparedQuantWeight(dense, kernel, exact_float32=exact)


def torch_quant_linear(
    x: torch.Tensor, w: BlockQuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, w.dequantize()) in x's dtype."""
    return F.linear(x, w.dequantize(x.dtype), bias)


def quant_linear(
    x: torch.Tensor, w: PreparedQuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] W^T (+ bias) -> [..., N] in x's dtype."""
    q = w.weight
    if w.triton and x.is_cuda:
        return triton_quant_linear(x, q, bias)
    if w.kernel is None or x.device.type != "cpu":
        return torch_quant_linear(x, w.row_weight(), bias)
    if x.dim() != 2:
        return quant_linear(x.reshape(-1, x.shape[-1]), w, bias).reshape(*x.shape[:-1], -1)
    exact = x.dtype == torch.float32 and w.exact_float32
    if isinstance(q, StripQuantWeight):
        return _strip_linear(x, q, w.kernel, bias, exact, w.strip_int8_rows(x.dtype))
    args = (q.qweight, q.scales, q.mins, q.bits, q.block_size)
    out = None
    if x.dtype == torch.bfloat16 and x.shape[0] in TILE_ROWS:
        out = w.kernel.linear_bf16(x, *args, bias)  # None where the build has no bf16 dots
    if out is None and x.shape[0] <= (EXACT_ROWS if exact else INT8_ROWS):
        out = (w.kernel.linear_f32 if exact else w.kernel.linear_int8)(x, *args, bias)
    elif out is None:
        out = _dequantized_linear(x, w.kernel.dequantize_into, q.shape, args, bias)
    return torch_quant_linear(x, q, bias) if out is None else out


def _strip_linear(
    x: torch.Tensor,
    q: StripQuantWeight,
    kernel: ModuleType,
    bias: torch.Tensor | None,
    exact: bool,
    int8_rows: int | None,
) -> torch.Tensor:
    args, rows = (q.q, q.scales, q.mins, q.bits, q.block_size), x.shape[0]
    if not exact and (int8_rows is None or rows <= int8_rows):
        out = kernel.strip_linear_int8(x, *args, bias)
    elif exact and rows <= (STRIP_EXACT_ROWS_HEAD if q.shape[0] > HEAD_ROWS else STRIP_EXACT_ROWS):
        out = kernel.strip_linear_f32(x, *args, bias)
    else:
        out = _dequantized_linear(x, kernel.strip_dequantize_into, q.shape, args, bias)
    return torch_quant_linear(x, q.row_weight(), bias) if out is None else out


def _dequantized_linear(
    x: torch.Tensor,
    dequantize_into: Callable[..., bool],
    shape: tuple[int, int],
    args: tuple,
    bias: torch.Tensor | None,
) -> torch.Tensor | None:
    """F.linear on the weight dequantized by the C++ into x's dtype; None where it declines."""
    weight = torch.empty(shape, dtype=x.dtype)
    return F.linear(x, weight, bias) if dequantize_into(weight, *args) else None
