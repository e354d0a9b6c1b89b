"""Weight-only quantized matmul in Triton, y = x W^T (+ bias), for CUDA tensors: W a
BlockQuantWeight (4 or 8 bits), or float8_e4m3fn with a per-channel or per-tensor scale.

A program owns a [BLOCK_M, BLOCK_N] tile of y and walks K in BLOCK_K steps, reading the
stored integers (or fp8 values) of W straight into registers; W is never dequantized into
memory. A K step lies in one quantization block (BLOCK_K divides the block, or one block
spans K), so its scale and min are one value per output feature: the step's dot product of
x with the raw values (integers and fp8 values are exact in x's dtype) is scaled after the dot,
in float32,

    sum_k x[m, k] * (s[n] * q[n, k] + min[n]) = s[n] * (x . q)[m, n] + min[n] * sum_k x[m, k]

and accumulated in float32. Decode batches (M <= SKINNY_M) take narrow, deep tiles, for
more programs over N; larger batches take square-ish tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from models.quantization.block_quant import BlockQuantWeight

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_BITS = 0  # the kernel's BITS for float8_e4m3fn values
SKINNY_M = 16


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    max_block_k: int
    num_warps: int
    num_stages: int


# (decode, general) tiles for 16-bit activations, whose dots run on tensor cores, and for
# float32 ones, whose exact dots run on FMA units and need smaller tiles to fit registers.
TILES = {  # keyed by "x is float32"
    False: (Tiles(16, 32, 128, 4, 4), Tiles(64, 64, 64, 4, 3)),
    True: (Tiles(16, 32, 64, 4, 2), Tiles(64, 64, 32, 8, 2)),
}


@triton.jit(do_not_specialize=["m"])
def _quant_matmul_kernel(
    x_ptr,
    q_ptr,
    scales_ptr,
    mins_ptr,
    bias_ptr,
    out_ptr,
    m,
    n,
    k,
    x_stride,
    q_stride,
    scale_stride_n,
    scale_stride_b,
    out_stride,
    QUANT_BLOCK: tl.constexpr,
    BITS: tl.constexpr,
    HAS_MINS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # 64-bit offsets of the tile's first row and column; 32-bit ones within the tile
    row0 = tl.program_id(1).to(tl.int64) * BLOCK_M
    col0 = tl.program_id(0).to(tl.int64) * BLOCK_N
    x_ptr += row0 * x_stride
    q_ptr += col0 * q_stride
    scales_ptr += col0 * scale_stride_n
    mins_ptr += col0 * scale_stride_n
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < m - row0
    col_ok = cols < n - col0
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        x_mask = row_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_stride + ks[None, :], x_mask, other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        if BITS == 4:  # byte i of a 32-run: element i low, element i + 16 high
            byte = (ks // 32) * 16 + ks % 16
            shift = (ks // 16 % 2) * 4
            packed = tl.load(q_ptr + cols[None, :] * q_stride + byte[:, None], w_mask, other=0)
            q = (packed.to(tl.int32) >> shift[:, None]) & 0xF
        elif BITS == 8:
            q = tl.load(q_ptr + cols[None, :] * q_stride + ks[:, None], w_mask, other=0)
        else:
            q = tl.load(q_ptr + cols[None, :] * q_stride + ks[:, None], w_mask, other=0.0)
        part = tl.dot(x, q.to(x.dtype), input_precision=DOT_PRECISION)
        at = cols * scale_stride_n + (k0 // QUANT_BLOCK) * scale_stride_b
        scale = tl.load(scales_ptr + at, col_ok, other=0.0).to(tl.float32)
        acc += part * scale[None, :]
        if HAS_MINS:
            low = tl.load(mins_ptr + at, col_ok, other=0.0).to(tl.float32)
            acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * low[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col0 + cols, col_ok, other=0.0).to(tl.float32)[None, :]
    out_at = row0 * out_stride + col0 + rows[:, None] * out_stride + cols[None, :]
    tl.store(out_ptr + out_at, acc.to(out_ptr.dtype.element_ty), row_ok[:, None] & col_ok[None, :])


def block_k_step(quant_block: int, k: int, cap: int) -> int:
    """The K step: any (the tail masked) when one block spans K, else the largest power
    of 2 up to `cap` dividing the block (at least 16: blocks are multiples of 16)."""
    return cap if quant_block == k else min(quant_block & -quant_block, cap)


def _launch(
    x: torch.Tensor,
    values: torch.Tensor,
    bits: int,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    quant_block: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """y for the stored values [N, *] with scales (and mins) [N, K / quant_block]."""
    n, k = scales.shape[0], scales.shape[1] * quant_block
    if x.shape[-1] != k or x.dtype not in DTYPES:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit a [{n}, {k}] weight")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit {n} output features")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if mins is not None and mins.stride() != scales.stride():  # the kernel reads both alike
        scales, mins = scales.contiguous(), mins.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        tiles = TILES[x.dtype == torch.float32][m > SKINNY_M]
        grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(m, tiles.block_m))
        _quant_matmul_kernel[grid](
            x2,
            values,
            scales,
            mins if mins is not None else scales,
            bias if bias is not None else scales,
            out,
            m,
            n,
            k,
            x2.stride(0),
            values.stride(0),
            scales.stride(0),
            scales.stride(1),
            out.stride(0),
            QUANT_BLOCK=quant_block,
            BITS=bits,
            HAS_MINS=mins is not None,
            HAS_BIAS=bias is not None,
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n,
            BLOCK_K=block_k_step(quant_block, k, tiles.max_block_k),
            # A float32 model gets float32 dots; tensor cores would round x to tf32.
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )
    return out.reshape(*x.shape[:-1], n)


def triton_quant_linear(
    x: torch.Tensor, w: BlockQuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] (float32, bfloat16 or float16) @ w^T (+ bias [N]) in x's dtype."""
    if w.qweight.stride(1) != 1:
        raise ValueError("qweight rows must be contiguous")
    return _launch(x, w.qweight, w.bits, w.scales, w.mins, w.block_size, bias)


def triton_fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ (scale * weight)^T (+ bias [N]) in x's dtype: weight float8_e4m3fn
    [N, K] (rows contiguous), scale one value per output feature ([N] or [N, 1]) or one
    for the whole tensor. Triton compiles float8_e4m3fn for compute capability 8.9 on."""
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn or weight.stride(1) != 1:
        raise ValueError(f"weight must be float8_e4m3fn with contiguous rows, got {weight.dtype}")
    if scale.numel() not in (1, n):
        raise ValueError(f"scale of {scale.numel()} values fits neither the tensor nor {n} rows")
    scales = scale.reshape(-1, 1).expand(n, 1)  # one block of K per row; stride 0 per tensor
    return _launch(x, weight, FP8_BITS, scales, None, k, bias)
