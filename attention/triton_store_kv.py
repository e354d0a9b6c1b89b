"""Store-KV on CUDA: one Triton program writes a tile of tokens x head_dim of one KV head."""

import torch
import triton
import triton.language as tl

from attention.triton_fp8 import page_format, quantize_fp8


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    k_scale,
    v_scale,
    num_tokens,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE: tl.constexpr,
    FP8: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    LIMIT: tl.constexpr,
):
    tokens = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    head = tl.program_id(1).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    slots = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    mask = (slots >= 0)[:, None] & (dims < HEAD_DIM)[None, :]
    cache_rows = (slots // BLOCK_SIZE) * cache_stride_b + (slots % BLOCK_SIZE) * cache_stride_s
    cache_offsets = (cache_rows + head * cache_stride_h)[:, None] + dims[None, :]
    k = tl.load(k_ptr + (tokens * k_stride_t + head * k_stride_h)[:, None] + dims[None, :], mask)
    v = tl.load(v_ptr + (tokens * v_stride_t + head * v_stride_h)[:, None] + dims[None, :], mask)
    if FP8:
        k = quantize_fp8(k, k_scale, MANT, BIAS, LIMIT)
        v = quantize_fp8(v, v_scale, MANT, BIAS, LIMIT)
    tl.store(key_cache_ptr + cache_offsets, k, mask)
    tl.store(value_cache_ptr + cache_offsets, v, mask)


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    tile: int = 64,
) -> None:
    """Same contract as store_kv_torch: k/v [T, num_kv_heads, head_dim] (any strides
    with a contiguous last dim), kv_cache [2, num_blocks, block_size, num_kv_heads,
    head_dim], slot -1 skipped, an fp8 cache written divided by the scales."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    assert k.stride(-1) == v.stride(-1) == kv_cache.stride(-1) == 1
    pages, fp8 = page_format(kv_cache)
    key_cache, value_cache = pages.unbind(0)
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    grid = (triton.cdiv(num_tokens, tile), num_kv_heads)
    _store_kv_kernel[grid](
        k,
        v,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale,
        v_scale,
        num_tokens,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        TILE=tile,
        **fp8,
    )
