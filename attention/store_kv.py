"""The store-KV step with torch ops: every backend's default and the reference of the
kernels that replace it."""

import torch

from attention.kv_cache_dtype import is_fp8, quantize_fp8


def store_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write k/v ([T, num_kv_heads, head_size]) into kv_cache ([2, num_blocks, block_size,
    num_kv_heads, head_size]) at flat slot ids; slots of -1 (padding) are skipped. An fp8
    cache stores k / k_scale and v / v_scale (attention/kv_cache_dtype.py)."""
    num_tokens = slot_mapping.shape[0]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    keys, values = k[:num_tokens][valid], v[:num_tokens][valid]
    cache = kv_cache
    if is_fp8(kv_cache.dtype):  # no index_copy_ for fp8: copy the bytes
        keys = quantize_fp8(keys, k_scale, kv_cache.dtype).view(torch.uint8)
        values = quantize_fp8(values, v_scale, kv_cache.dtype).view(torch.uint8)
        cache = kv_cache.view(torch.uint8)
    cache[0].view(-1, *cache.shape[3:]).index_copy_(0, slots, keys)
    cache[1].view(-1, *cache.shape[3:]).index_copy_(0, slots, values)
