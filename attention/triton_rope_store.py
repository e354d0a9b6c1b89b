"""Rotary embedding on CUDA, in Triton, fused with the store-KV step where the attention
backend asks: one program per token rotates the token's q heads and k heads in place (neox
style) and, storing, writes the rotated k and its v into the paged KV cache at the token's
slot (slot -1, padding, is not written; an fp8 cache gets them divided by the layer's
scales, attention/triton_fp8.py). Without the store it is the rotary kernel of the layers
(models/layers/triton_ops.py).

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
from attention.triton_fp8 import page_format, quantize_fp8

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _load_cos_sin(cos_ptr, sin_ptr, position, dims, dims_mask, like_ptr, HALF: tl.constexpr):
    """cos and sin [HALF_PAD] at `position` from the float32 caches, rounded to like_ptr's
    dtype as the torch code looks them up, in float32."""
    dtype = like_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + position * HALF + dims, dims_mask, other=0.0)
    sin = tl.load(sin_ptr + position * HALF + dims, dims_mask, other=0.0)
    return cos.to(dtype).to(tl.float32), sin.to(dtype).to(tl.float32)


@triton.jit
def _rotate_heads(
    row_ptr,
    head_stride,
    cos,
    sin,
    dims,
    dims_mask,
    HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    """Rotates in place the HEADS heads, head_stride apart, of one token's row by cos and sin
    [1, HALF_PAD] (neox: each head's halves (a, b) -> (a cos - b sin, b cos + a sin)), each
    product and sum rounded to the row's dtype as the torch code rounds them. Returns the
    rotated halves [HEADS_PAD, HALF_PAD] and the mask of the heads' values."""
    dtype = row_ptr.dtype.element_ty
    heads = tl.arange(0, HEADS_PAD)
    mask = (heads < HEADS)[:, None] & dims_mask[None, :]
    first = row_ptr + heads[:, None] * head_stride + dims[None, :]
    a = tl.load(first, mask, other=0.0).to(tl.float32)
    b = tl.load(first + HALF, mask, other=0.0).to(tl.float32)
    a_cos = (a * cos).to(dtype).to(tl.float32)
    b_sin = (b * sin).to(dtype).to(tl.float32)
    b_cos = (b * cos).to(dtype).to(tl.float32)
    a_sin = (a * sin).to(dtype).to(tl.float32)
    rotated_a, rotated_b = (a_cos - b_sin).to(dtype), (b_cos + a_sin).to(dtype)
    tl.store(first, rotated_a, mask)
    tl.store(first + HALF, rotated_b, mask)
    return rotated_a, rotated_b, mask


@triton.jit
def _rope_kernel(
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    slot_mapping_ptr,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    k_scale,
    v_scale,
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
    STORE_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    LIMIT: tl.constexpr,
):
    half: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    dims_mask = dims < half
    cos, sin = _load_cos_sin(cos_ptr, sin_ptr, position, dims, dims_mask, q_ptr, half)
    cos, sin = cos[None, :], sin[None, :]

    q_row = q_ptr + token * q_stride_t
    _rotate_heads(q_row, q_stride_h, cos, sin, dims, dims_mask, Q_HEADS, Q_HEADS_PAD, half)
    k_row = k_ptr + token * k_stride_t
    k1, k2, kv_mask = _rotate_heads(
        k_row, k_stride_h, cos, sin, dims, dims_mask, KV_HEADS, KV_HEADS_PAD, half
    )
    if STORE_KV:
        kv_heads = tl.arange(0, KV_HEADS_PAD)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        cache_mask = kv_mask & (slot >= 0)
        cache_row = (slot // BLOCK_SIZE) * cache_stride_b + (slot % BLOCK_SIZE) * cache_stride_s
        cache_first = cache_row + kv_heads[:, None] * cache_stride_h + dims[None, :]
        v_first = v_ptr + token * v_stride_t + kv_heads[:, None] * v_stride_h + dims[None, :]
        v1, v2 = tl.load(v_first, cache_mask), tl.load(v_first + half, cache_mask)
        if FP8:
            k1 = quantize_fp8(k1, k_scale, MANT, BIAS, LIMIT)
            k2 = quantize_fp8(k2, k_scale, MANT, BIAS, LIMIT)
            v1 = quantize_fp8(v1, v_scale, MANT, BIAS, LIMIT)
            v2 = quantize_fp8(v2, v_scale, MANT, BIAS, LIMIT)
        tl.store(key_cache_ptr + cache_first, k1, cache_mask)
        tl.store(key_cache_ptr + cache_first + half, k2, cache_mask)
        tl.store(value_cache_ptr + cache_first, v1, cache_mask)
        tl.store(value_cache_ptr + cache_first + half, v2, cache_mask)


def rotate_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    tables: RopeTables,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> bool:
    """Rotates q and k in place at the tables' positions and stores the rotated k and v in
    kv_cache at slot_mapping, in one launch. It takes q [T, heads, head_dim], k and v [T,
    kv_heads, head_dim] (any token and head strides, the last dimension contiguous) and
    kv_cache [2, num_blocks, block_size, kv_heads, head_dim], all of the tables' dtype (or
    an fp8 cache, written divided by the scales) and head_dim, with one slot and one
    position per token; False, touching nothing, for tensors it does not take."""
    dtype, head_dim, num_tokens = tables.dtype, tables.head_dim, q.shape[0]
    rows_fit = all(
        t.dtype == dtype
        and t.dim() == 3
        and t.shape[0] == num_tokens
        and t.shape[2] == head_dim
        and t.stride(2) == 1
        for t in (q, k, v)
    )
    if not (
        rows_fit
        and dtype in DTYPES
        and k.shape == v.shape
        and kv_cache.dtype in (dtype, torch.float8_e4m3fn, torch.float8_e5m2)
        and kv_cache.dim() == 5
        and kv_cache.shape[3:] == k.shape[1:]
        and kv_cache.stride(4) == 1
        and slot_mapping.shape == (num_tokens,)
        and tables.positions.shape == (num_tokens,)
    ):
        return False
    pages, fp8 = page_format(kv_cache)
    key_cache, value_cache = pages.unbind(0)
    positions, cos_cache, sin_cache = tables.positions, tables.cos_cache, tables.sin_cache
    store = (slot_mapping, v, key_cache, value_cache, k_scale, v_scale, fp8)
    rotate(positions, cos_cache, sin_cache, q, k, store)
    return True


def rotate(
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    store: tuple | None = None,
) -> None:
    """Rotates q [T, heads, head_dim] and k [T, kv_heads, head_dim] (of one dtype, any token
    and head strides, the last dimension contiguous) in place by the contiguous float32
    cos/sin caches [max_position, head_dim / 2] at positions [T] (contiguous integers within
    the caches), one program per token; with `store` (slot_mapping, v, key_cache,
    value_cache, k_scale, v_scale, the page format's constexprs: triton_fp8.page_format),
    also stores the rotated k and v. Without it, the rotary kernel of
    models/layers/triton_ops.py."""
    num_tokens, q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    kv_heads = k.shape[1]
    if store is None:  # the store's arguments are read by no program
        slot_mapping, v, key_cache, value_cache, k_scale, v_scale = positions, k, k, k, 1.0, 1.0
        block_size, cache_strides = 1, (0, 0, 0)
        fp8 = page_format(k)[1]
    else:
        slot_mapping, v, key_cache, value_cache, k_scale, v_scale, fp8 = store
        block_size, cache_strides = key_cache.shape[1], key_cache.stride()[:3]
    _rope_kernel[(num_tokens,)](
        positions,
        cos_cache,
        sin_cache,
        q,
        k,
        slot_mapping,
        v,
        key_cache,
        value_cache,
        k_scale,
        v_scale,
        *q.stride()[:2],
        *k.stride()[:2],
        *v.stride()[:2],
        *cache_strides,
        Q_HEADS=q_heads,
        Q_HEADS_PAD=triton.next_power_of_2(q_heads),
        KV_HEADS=kv_heads,
        KV_HEADS_PAD=triton.next_power_of_2(kv_heads),
        HEAD_DIM=head_dim,
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
        STORE_KV=store is not None,
        BLOCK_SIZE=block_size,
        **fp8,
        enable_fp_fusion=False,  # no FMA: each product is rounded, as in torch
    )
