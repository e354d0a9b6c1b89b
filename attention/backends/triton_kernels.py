"""Paged attention in Triton: one kernel source, launched as a prefill and a decode kernel.

A program owns one request, one tile of BLOCK_Q query tokens and one KV head. Its rows
are the tile's (token, query head) pairs for the GROUP query heads that share that KV
head, so every K/V tile read from the cache serves the whole group (GQA without
repeating K/V). The program walks the request's context in tiles of BLOCK_N positions,
looking each position's page up in the block table, and keeps an online softmax in
float32. The decode launch is BLOCK_Q = 1: the rows are just the group's heads. Rows
are padded to BLOCK_M >= 16 for tl.dot; padded rows are masked, never computed for the
next tile's tokens.

Flash-decoding (split KV): a decode launch may split each request's visible context into
NUM_SPLITS ranges of whole key tiles, one program each (grid axis 1). The ranges are cut
from this step's seq_len on the device, so the grid depends only on the launch's size (a
CUDA graph can replay it); a range that is empty (a short context, or one wholly before
the sliding window) leaves a neutral partial. Each program writes its unnormalised
partial (running max, sum, accumulator) in float32 to scratch, and a small kernel
combines the NUM_SPLITS partials of every (request, head) into `out`.

fp8 pages (attention/triton_fp8.py) are widened to q's dtype as they are loaded (exact);
the layer's k_scale is folded into the score scale and its v_scale into the accumulator
as it is written out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attention.triton_fp8 import dequantize_fp8, page_format

LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    out_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    req_ids_ptr,
    scale_log2,
    v_scale,
    sliding_window,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    block_table_stride,
    partial_max_ptr,
    partial_sum_ptr,
    partial_acc_ptr,
    num_heads,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FP8: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    LIMIT: tl.constexpr,
):
    launch_row = tl.program_id(0).to(tl.int64)
    req = tl.load(req_ids_ptr + launch_row).to(tl.int64)
    q_tile = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    kv_head = tl.program_id(2).to(tl.int64)
    q_start = tl.load(query_start_loc_ptr + req).to(tl.int64)
    query_len = tl.load(query_start_loc_ptr + req + 1).to(tl.int64) - q_start
    if q_tile * BLOCK_Q < query_len:
        seq_len = tl.load(seq_lens_ptr + req).to(tl.int64)
        context_start = seq_len - query_len

        rows = tl.arange(0, BLOCK_M)
        token = q_tile * BLOCK_Q + rows // GROUP_PAD
        head = kv_head * GROUP + rows % GROUP_PAD
        row_valid = (rows < BLOCK_Q * GROUP_PAD) & (rows % GROUP_PAD < GROUP) & (token < query_len)
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_valid = dims < HEAD_DIM
        q_offsets = ((q_start + token) * q_stride_t + head * q_stride_h)[:, None] + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
        query_pos = context_start + token

        end = context_start + tl.minimum(query_len, (q_tile + 1) * BLOCK_Q)  # causal bound
        start = 0
        if SLIDING:
            first_pos = context_start + q_tile * BLOCK_Q - sliding_window + 1
            start = tl.maximum(first_pos, 0) // BLOCK_N * BLOCK_N
        if NUM_SPLITS > 1:  # this program's share of the key tiles
            tiles_per_split = tl.cdiv(tl.cdiv(end - start, BLOCK_N), NUM_SPLITS)
            start += split * tiles_per_split * BLOCK_N
            end = tl.minimum(end, start + tiles_per_split * BLOCK_N)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        block_row = block_table_ptr + req * block_table_stride
        for tile_start in range(start, end, BLOCK_N):
            pos = tile_start + tl.arange(0, BLOCK_N)
            pos_valid = pos < end
            block = tl.load(block_row + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
            slot_offsets = (
                block * cache_stride_b + (pos % BLOCK_SIZE) * cache_stride_s
            ) + kv_head * cache_stride_h
            kv_offsets = slot_offsets[:, None] + dims[None, :]
            kv_mask = pos_valid[:, None] & dim_valid[None, :]
            k = tl.load(key_cache_ptr + kv_offsets, mask=kv_mask, other=0)
            if FP8:
                k = dequantize_fp8(k, 1.0, MANT).to(q.dtype)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            visible = pos_valid[None, :] & (pos[None, :] <= query_pos[:, None])
            if SLIDING:
                visible &= pos[None, :] > query_pos[:, None] - sliding_window
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(scores - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(value_cache_ptr + kv_offsets, mask=kv_mask, other=0)
            if FP8:
                v = dequantize_fp8(v, 1.0, MANT).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        out_mask = row_valid[:, None] & dim_valid[None, :]
        acc = acc * v_scale
        if NUM_SPLITS > 1:
            partial = (launch_row * num_heads + head) * NUM_SPLITS + split
            tl.store(partial_max_ptr + partial, m_i, row_valid)
            tl.store(partial_sum_ptr + partial, l_i, row_valid)
            acc_offsets = partial[:, None] * HEAD_DIM + dims[None, :]
            tl.store(partial_acc_ptr + acc_offsets, acc, out_mask)
        else:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            out_rows = (q_start + token) * out_stride_t + head * out_stride_h
            tl.store(
                out_ptr + out_rows[:, None] + dims[None, :],
                out.to(out_ptr.dtype.element_ty),
                out_mask,
            )


@triton.jit
def _combine_splits_kernel(
    out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    partial_acc_ptr,
    query_start_loc_ptr,
    req_ids_ptr,
    num_heads,
    out_stride_t,
    out_stride_h,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """One program per (decode, query head): rescale each split's partial to the common
    max and divide by the total sum. Neutral partials (max -inf) weigh nothing."""
    launch_row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    req = tl.load(req_ids_ptr + launch_row).to(tl.int64)
    q_start = tl.load(query_start_loc_ptr + req).to(tl.int64)
    if tl.load(query_start_loc_ptr + req + 1).to(tl.int64) > q_start:
        splits = tl.arange(0, SPLITS_PAD)
        split_valid = splits < NUM_SPLITS
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_valid = dims < HEAD_DIM
        partial = (launch_row * num_heads + head) * NUM_SPLITS + splits
        maxes = tl.load(partial_max_ptr + partial, mask=split_valid, other=float("-inf"))
        sums = tl.load(partial_sum_ptr + partial, mask=split_valid, other=0.0)
        acc_mask = split_valid[:, None] & dim_valid[None, :]
        acc_offsets = partial[:, None] * HEAD_DIM + dims[None, :]
        acc = tl.load(partial_acc_ptr + acc_offsets, mask=acc_mask, other=0.0)
        weight = tl.exp2(maxes - tl.max(maxes, 0))  # a decode sees its own position: finite
        out = tl.sum(weight[:, None] * acc, 0) / tl.sum(weight * sums, 0)
        out_offsets = q_start * out_stride_t + head * out_stride_h + dims
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), dim_valid)


@dataclass(frozen=True)
class SplitPartials:
    """Float32 scratch of a split decode launch of up to `rows` requests: per (request,
    query head, split) the running max (log2 units), the sum of exponentials and the
    unnormalised accumulator. Allocate once per shape and reuse: a CUDA graph bakes in
    the addresses."""

    max: torch.Tensor  # [rows, num_heads, num_splits]
    sum: torch.Tensor  # [rows, num_heads, num_splits]
    acc: torch.Tensor  # [rows, num_heads, num_splits, head_dim]

    @classmethod
    def empty(
        cls, rows: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
    ) -> SplitPartials:
        shape = (rows, num_heads, num_splits)
        return cls(
            torch.empty(shape, dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device),
            torch.empty((*shape, head_dim), dtype=torch.float32, device=device),
        )

    @property
    def num_splits(self) -> int:
        return self.max.shape[2]


def paged_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    req_ids: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None,
    block_q: int,
    block_n: int = 32,
    partials: SplitPartials | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Attend the query tokens of requests req_ids, writing their rows of out.

    q/out [T, num_heads, head_dim], kv_cache [2, num_blocks, block_size, num_kv_heads,
    head_dim], last dims contiguous. block_q = 1 is the decode kernel; a decode launch
    given `partials` splits each context into partials.num_splits ranges. num_warps and
    num_stages go to Triton's launcher (None: its defaults). An fp8 cache is read times
    k_scale and v_scale.
    """
    pages, fp8 = page_format(kv_cache)
    if not fp8["FP8"]:
        k_scale = v_scale = 1.0
    key_cache, value_cache = pages.unbind(0)
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    assert q.stride(-1) == out.stride(-1) == key_cache.stride(-1) == 1
    group = q.shape[1] // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    num_heads, num_splits = q.shape[1], 1
    if partials is not None:
        rows, partial_heads, num_splits, partial_dim = partials.acc.shape
        assert block_q == 1 and num_splits > 1 and rows >= req_ids.shape[0]
        assert (partial_heads, partial_dim) == (num_heads, head_dim)
    scratch = (out, out, out) if partials is None else (partials.max, partials.sum, partials.acc)
    num_q_tiles = triton.cdiv(max_query_len, block_q)
    grid = (req_ids.shape[0], num_q_tiles * num_splits, num_kv_heads)
    tuning = {"num_warps": num_warps, "num_stages": num_stages}
    _paged_attention_kernel[grid](
        q,
        out,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        req_ids,
        scale * LOG2E * k_scale,
        v_scale,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        *scratch,
        num_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=max(16, block_q * group_pad),  # tl.dot needs 16 rows on GPUs
        BLOCK_N=block_n,
        SLIDING=sliding_window is not None,
        # A float32 model gets float32 dots, as torch's matmuls give it; tensor cores would
        # round the inputs to tf32 (about 1e-3 off on a GPU).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        NUM_SPLITS=num_splits,
        **fp8,
        **{name: value for name, value in tuning.items() if value is not None},
    )
    if partials is not None:
        _combine_splits_kernel[(req_ids.shape[0], num_heads)](
            out,
            partials.max,
            partials.sum,
            partials.acc,
            query_start_loc,
            req_ids,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
