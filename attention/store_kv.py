import torch

from attention.backends.cpu_backend import load_cpu_attention
from attention.triton_store_kv import store_kv_triton


def store_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k/v ([T, num_kv_heads, head_dim]) into kv_cache ([2, num_blocks, block_size,
    num_kv_heads, head_dim]) at flat slot ids; slots of -1 (padding) are skipped.
    A Triton kernel on CUDA, a C++ row copy on CPU (cpu_attn.cpp), vectorised
    index_copy_ elsewhere."""
    if kv_cache.is_cuda:
        store_kv_triton(k, v, kv_cache, slot_mapping)
        return
    kernels = load_cpu_attention() if kv_cache.device.type == "cpu" else None
    if kernels is not None and _dense_rows(k) and _dense_rows(v):
        kernels.store_kv(k, v, kv_cache, slot_mapping)
        return
    num_tokens = slot_mapping.shape[0]
    key_cache = kv_cache[0].view(-1, *kv_cache.shape[3:])
    value_cache = kv_cache[1].view(-1, *kv_cache.shape[3:])
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    key_cache.index_copy_(0, slots, k[:num_tokens][valid])
    value_cache.index_copy_(0, slots, v[:num_tokens][valid])


def _dense_rows(x: torch.Tensor) -> bool:
    return x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]
