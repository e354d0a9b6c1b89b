"""Rotary embedding fused with the store-KV step, on CUDA: one Triton program per token
rotates the token's q heads and k heads in place (neox style) and writes the rotated k and
its v into the paged KV cache at the token's slot (slot -1, padding, is not written).

It rounds as the torch code does (`apply_rotary` in models/layers/rotary.py, then the
store): cos/sin rounded to the tensors' dtype, each product and each sum rounded to it,
float32 in between. The launch reads only device tensors (q, k, v, the cache, positions,
the slot mapping, the cos/sin caches) and host values fixed by shapes and strides, so a
captured CUDA graph replays it over rewritten step buffers.
"""

import torch
import triton
import triton.language as tl

from attention.rotation import RopeTables

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rope_store_fits(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    tables: RopeTables,
) -> bool:
    """Whether the kernel takes q [T, heads, head_dim], k and v [T, kv_heads, head_dim]
    (any token and head strides, the last dimension contiguous) and kv_cache [2,
    num_blocks, block_size, kv_heads, head_dim], all of the tables' dtype and head_dim,
    with one slot and one position per token."""
    dtype, head_dim, num_tokens = tables.dtype, tables.head_dim, q.shape[0]
    rows_fit = all(
        t.dtype == dtype
        and t.dim() == 3
        and t.shape[0] == num_tokens
        and t.shape[2] == head_dim
        and t.stride(2) == 1
        for t in (q, k, v)
    )
    return (
        rows_fit
        and dtype in DTYPES
        and k.shape == v.shape
        and kv_cache.dtype == dtype
        and kv_cache.dim() == 5
        and kv_cache.shape[3:] == k.shape[1:]
        and kv_cache.stride(4) == 1
        and slot_mapping.shape == (num_tokens,)
        and tables.positions.shape == (num_tokens,)
    )


@triton.jit
def load_cos_sin(cos_ptr, sin_ptr, position, dims, dims_mask, like_ptr, HALF: tl.constexpr):
    """cos and sin [HALF_PAD] at `position` from the float32 caches, rounded to like_ptr's
    dtype as the torch code looks them up, in float32. Shared with the rotary kernel of
    models/layers/triton_ops.py."""
    dtype = like_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + position * HALF + dims, dims_mask, other=0.0)
    sin = tl.load(sin_ptr + position * HALF + dims, dims_mask, other=0.0)
    return cos.to(dtype).to(tl.float32), sin.to(dtype).to(tl.float32)


@triton.jit
def rotated_halves(first_ptrs, mask, cos, sin, HALF: tl.constexpr):
    """The neox rotation of the halves at first_ptrs and first_ptrs + HALF, in their dtype,
    each product and sum rounded as the torch code rounds them."""
    dtype = first_ptrs.dtype.element_ty
    a = tl.load(first_ptrs, mask, other=0.0).to(tl.float32)
    b = tl.load(first_ptrs + HALF, mask, other=0.0).to(tl.float32)
    a_cos = (a * cos).to(dtype).to(tl.float32)
    b_sin = (b * sin).to(dtype).to(tl.float32)
    b_cos = (b * cos).to(dtype).to(tl.float32)
    a_sin = (a * sin).to(dtype).to(tl.float32)
    return (a_cos - b_sin).to(dtype), (b_cos + a_sin).to(dtype)


@triton.jit
def _rope_store_kv_kernel(
    positions_ptr,
    slot_mapping_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    Q_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    half: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    dims_mask = dims < half
    cos, sin = load_cos_sin(cos_ptr, sin_ptr, position, dims, dims_mask, q_ptr, half)
    cos, sin = cos[None, :], sin[None, :]

    q_heads = tl.arange(0, Q_HEADS_PAD)
    q_mask = (q_heads < Q_HEADS)[:, None] & dims_mask[None, :]
    q_first = q_ptr + token * q_stride_t + q_heads[:, None] * q_stride_h + dims[None, :]
    q1, q2 = rotated_halves(q_first, q_mask, cos, sin, half)
    tl.store(q_first, q1, q_mask)
    tl.store(q_first + half, q2, q_mask)

    kv_heads = tl.arange(0, KV_HEADS_PAD)
    kv_mask = (kv_heads < KV_HEADS)[:, None] & dims_mask[None, :]
    k_first = k_ptr + token * k_stride_t + kv_heads[:, None] * k_stride_h + dims[None, :]
    k1, k2 = rotated_halves(k_first, kv_mask, cos, sin, half)
    tl.store(k_first, k1, kv_mask)
    tl.store(k_first + half, k2, kv_mask)

    cache_mask = kv_mask & (slot >= 0)
    cache_row = (slot // BLOCK_SIZE) * cache_stride_b + (slot % BLOCK_SIZE) * cache_stride_s
    cache_first = cache_row + kv_heads[:, None] * cache_stride_h + dims[None, :]
    tl.store(key_cache_ptr + cache_first, k1, cache_mask)
    tl.store(key_cache_ptr + cache_first + half, k2, cache_mask)
    v_first = v_ptr + token * v_stride_t + kv_heads[:, None] * v_stride_h + dims[None, :]
    tl.store(value_cache_ptr + cache_first, tl.load(v_first, cache_mask), cache_mask)
    tl.store(value_cache_ptr + cache_first + half, tl.load(v_first + half, cache_mask), cache_mask)


def rotate_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    tables: RopeTables,
) -> None:
    """Rotates q and k in place at the tables' positions and stores the rotated k and v in
    kv_cache at slot_mapping, in one launch (the tensors: see `rope_store_fits`)."""
    num_tokens, q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    key_cache, value_cache = kv_cache.unbind(0)
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    _rope_store_kv_kernel[(num_tokens,)](
        tables.positions,
        slot_mapping,
        tables.cos_cache,
        tables.sin_cache,
        q,
        k,
        v,
        key_cache,
        value_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        Q_HEADS=q_heads,
        Q_HEADS_PAD=triton.next_power_of_2(q_heads),
        KV_HEADS=kv_heads,
        KV_HEADS_PAD=triton.next_power_of_2(kv_heads),
        HEAD_DIM=head_dim,
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
        BLOCK_SIZE=block_size,
        enable_fp_fusion=False,  # no FMA: each product is rounded, as in torch
    )
