"""Fused block-quantized experts in Triton for CUDA tensors: the two launches of
models/layers/triton_moe.py (pairs aligned by expert; gate-up with SiLU-and-mul; down
times the routing weight, the slots summed by torch) reading each expert's stacked
BlockQuantWeight (4 or 8 bits, a scale and an optional min per block of K; fp8 experts as
bits FP8_BITS, one block of K with a scale per output feature) straight into registers,
as triton_quant_linear.py does for one weight. A K step lies in one quantization block,
so its dot with the raw values (exact in x's dtype) is scaled after the dot, in float32,
and the min times the step's sum of x added:

    sum_k a[m, k] * (s[n] * q[n, k] + min[n]) = s[n] * (a . q)[m, n] + min[n] * sum_k a[m, k]

Gate and up held as one [2 I, H] weight per expert; where their input is gathered
(act-order, StackedQuantWeight.input_index) the kernel reads x's features through the
expert's index. One launch per projection for every expert, instead of a matmul per routed
expert. Rounding as the torch path's: gate, up, silu(gate), their product and each slot's
output in x's dtype; the slots summed in float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from models.layers.triton_moe import DTYPES, Tiles, block_rows, launch_experts, store_silu_mul
from models.quantization.triton_quant_linear import block_k_step

if TYPE_CHECKING:
    from models.quantization.quant_moe import StackedQuantWeight


@triton.jit
def _codes(q_cols, ks, mask, BITS: tl.constexpr):
    """The stored values [BLOCK_K, BLOCK_N] of features ks of the weight rows at q_cols:
    4 bits in 32-runs (byte i holds element i low, element i + 16 high), int8, or fp8."""
    if BITS == 4:
        byte = (ks // 32) * 16 + ks % 16
        shift = (ks // 16 % 2) * 4
        packed = tl.load(q_cols[None, :] + byte[:, None], mask, other=0)
        codes = (packed.to(tl.int32) >> shift[:, None]) & 0xF
    elif BITS == 8:
        codes = tl.load(q_cols[None, :] + ks[:, None], mask, other=0).to(tl.int32)
    else:  # FP8_BITS: the fp8 values themselves
        codes = tl.load(q_cols[None, :] + ks[:, None], mask, other=0.0)
    return codes


@triton.jit
def _quant_step(acc, a, q_cols, s_cols, m_cols, ks, k0, w_mask, col_ok, s_stride_b,
                QUANT_BLOCK: tl.constexpr, BITS: tl.constexpr, HAS_MINS: tl.constexpr,
                DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """acc + a @ (one K step of the dequantized weight)^T, in float32."""
    codes = _codes(q_cols, ks, w_mask, BITS)
    if DOT_F32:
        part = tl.dot(a.to(tl.float32), codes.to(tl.float32), input_precision=DOT_PRECISION)
    else:
        part = tl.dot(a, codes.to(a.dtype), input_precision=DOT_PRECISION)
    at = (k0 // QUANT_BLOCK) * s_stride_b
    acc += part * tl.load(s_cols + at, col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_MINS:
        low = tl.load(m_cols + at, col_ok, other=0.0).to(tl.float32)
        acc += tl.sum(a.to(tl.float32), axis=1)[:, None] * low[None, :]
    return acc


@triton.jit(do_not_specialize=["num_pairs"])
def _quant_gate_up_kernel(
    x_ptr, index_ptr, q_ptr, scales_ptr, mins_ptr, act_ptr,
    sorted_ptr, expert_ptr, num_padded_ptr, num_pairs, top_k, hidden, inter,
    x_stride, q_stride_e, q_stride_n, s_stride_e, s_stride_n, s_stride_b, act_stride,
    QUANT_BLOCK: tl.constexpr, BITS: tl.constexpr, HAS_MINS: tl.constexpr,
    HAS_INDEX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    expert, pairs, row_ok = block_rows(sorted_ptr, expert_ptr, num_padded_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    e = expert.to(tl.int64)
    x_rows = x_ptr + (pairs // top_k) * x_stride
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    gate_q = q_ptr + e * q_stride_e + cols.to(tl.int64) * q_stride_n
    gate_s = scales_ptr + e * s_stride_e + cols.to(tl.int64) * s_stride_n
    gate_m = mins_ptr + e * s_stride_e + cols.to(tl.int64) * s_stride_n
    up_q, up_s, up_m = (
        gate_q + inter * q_stride_n,
        gate_s + inter * s_stride_n,
        gate_m + inter * s_stride_n,
    )
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        features = ks
        if HAS_INDEX:
            features = tl.load(index_ptr + e * hidden + ks, k_ok, other=0)
        a = tl.load(x_rows[:, None] + features[None, :], row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        gate = _quant_step(gate, a, gate_q, gate_s, gate_m, ks, k0, w_mask, col_ok, s_stride_b,
                           QUANT_BLOCK, BITS, HAS_MINS, DOT_F32, DOT_PRECISION)  # fmt: skip
        up = _quant_step(up, a, up_q, up_s, up_m, ks, k0, w_mask, col_ok, s_stride_b,
                         QUANT_BLOCK, BITS, HAS_MINS, DOT_F32, DOT_PRECISION)  # fmt: skip
    store_silu_mul(act_ptr, gate, up, pairs, cols, act_stride, row_ok, col_ok)


@triton.jit(do_not_specialize=["num_pairs"])
def _quant_down_kernel(
    act_ptr, q_ptr, scales_ptr, mins_ptr, weights_ptr, out_ptr,
    sorted_ptr, expert_ptr, num_padded_ptr, num_pairs, hidden, inter,
    act_stride, q_stride_e, q_stride_n, s_stride_e, s_stride_n, s_stride_b, out_stride,
    QUANT_BLOCK: tl.constexpr, BITS: tl.constexpr, HAS_MINS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    expert, pairs, row_ok = block_rows(sorted_ptr, expert_ptr, num_padded_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    e = expert.to(tl.int64)
    act_rows = act_ptr + pairs * act_stride
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_q = q_ptr + e * q_stride_e + cols.to(tl.int64) * q_stride_n
    w_s = scales_ptr + e * s_stride_e + cols.to(tl.int64) * s_stride_n
    w_m = mins_ptr + e * s_stride_e + cols.to(tl.int64) * s_stride_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(act_rows[:, None] + ks[None, :], row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        acc = _quant_step(acc, a, w_q, w_s, w_m, ks, k0, w_mask, col_ok, s_stride_b,
                          QUANT_BLOCK, BITS, HAS_MINS, DOT_F32, DOT_PRECISION)  # fmt: skip
    acc *= tl.load(weights_ptr + pairs, row_ok, other=0.0)[:, None]
    out_at = pairs[:, None] * out_stride + cols[None, :]
    tl.store(out_ptr + out_at, acc.to(out_ptr.dtype.element_ty), row_ok[:, None] & col_ok[None, :])


def triton_quant_moe_takes(
    x: torch.Tensor, gate_up: list[StackedQuantWeight], down: StackedQuantWeight
) -> bool:
    """Whether fused_quant_experts_triton takes these activations and experts: gate and up
    as one weight in rows (not strips), down not gathered."""
    return (
        x.is_cuda
        and x.dim() == 2
        and x.dtype in DTYPES
        and len(gate_up) == 1
        and not gate_up[0].strips
        and not down.strips
        and down.input_index is None
    )


def _weight_args(w: StackedQuantWeight) -> tuple[tuple, tuple]:
    """((q, scales, mins), their strides) as the kernels take them."""
    mins = w.mins if w.mins is not None else w.scales
    if mins.stride() != w.scales.stride():
        raise ValueError("an expert weight's scales and mins must share a layout")
    return (w.q, w.scales, mins), (w.q.stride(0), w.q.stride(1), *w.scales.stride())


def fused_quant_experts_triton(
    x: torch.Tensor,
    gate_up: StackedQuantWeight,
    down: StackedQuantWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """x [T, H] through the experts: gate_up [E] x [2 I, H] (gate rows, then up rows),
    down [E] x [H, I]; topk_weights [T, k] and topk_ids [T, k] (< 0: no local expert).
    Returns [T, H] in x's dtype. `tiles` overrides triton_moe's TILES."""
    num_tokens, hidden = x.shape
    experts, inter, top_k = down.q.shape[0], gate_up.scales.shape[1] // 2, topk_ids.shape[1]
    if gate_up.scales.shape[2] * gate_up.block_size != hidden or down.scales.shape[1] != hidden:
        raise ValueError(f"the experts do not fit x [{num_tokens}, {hidden}]")
    if down.scales.shape[2] * down.block_size != inter or down.input_index is not None:
        raise ValueError(f"down must take the {inter} gate-up features as they come")
    index = gate_up.input_index
    gate_up_tensors, gate_up_strides = _weight_args(gate_up)
    down_tensors, down_strides = _weight_args(down)

    def launch_gate_up(grid, x, act, alignment, meta):
        _quant_gate_up_kernel[grid](
            x, index if index is not None else alignment[0], *gate_up_tensors, act,
            *alignment, top_k, hidden, inter, x.stride(0), *gate_up_strides, act.stride(0),
            QUANT_BLOCK=gate_up.block_size, BITS=gate_up.bits,
            HAS_MINS=gate_up.mins is not None, HAS_INDEX=index is not None,
            BLOCK_K=block_k_step(gate_up.block_size, hidden, meta["tiles"].block_k),
            **meta["launch"],
        )  # fmt: skip

    def launch_down(grid, act, weights, out, alignment, meta):
        _quant_down_kernel[grid](
            act, *down_tensors, weights, out, *alignment, hidden, inter,
            act.stride(0), *down_strides, out.stride(0),
            QUANT_BLOCK=down.block_size, BITS=down.bits, HAS_MINS=down.mins is not None,
            BLOCK_K=block_k_step(down.block_size, inter, meta["tiles"].block_k),
            **meta["launch"],
        )  # fmt: skip

    return launch_experts(
        x, topk_weights, topk_ids, experts, inter, tiles, launch_gate_up, launch_down
    )
