"""The store-KV step with torch ops: every backend's default and the reference of the
kernels that replace it."""

import torch


def store_kv_torch(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k/v ([T, num_kv_heads, head_size]) into kv_cache ([2, num_blocks, block_size,
    num_kv_heads, head_size]) at flat slot ids; slots of -1 (padding) are skipped."""
    num_tokens = slot_mapping.shape[0]
    key_cache = kv_cache[0].view(-1, *kv_cache.shape[3:])
    value_cache = kv_cache[1].view(-1, *kv_cache.shape[3:])
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    key_cache.index_copy_(0, slots, k[:num_tokens][valid])
    value_cache.index_copy_(0, slots, v[:num_tokens][valid])
