"""The store of the CUDA backends: the Triton store-KV kernel, or rotary fused into it,
where the kernel set has the Triton kernels on; torch ops otherwise."""

import torch

from attention.backends.base import AttentionBackend
from attention.rotation import RopeTables
from attention.triton_rope_store import rotate_and_store_kv
from attention.triton_store_kv import store_kv_triton


class TritonStoreBackend(AttentionBackend):
    """A backend whose CUDA caches are written by Triton kernels unless `triton_store` is
    off (SPLITSERVE_TRITON_KERNELS=0, through the KernelSet). The torch store waits on the
    host for the slots it keeps, so without Triton no CUDA graph can capture the step."""

    def __init__(self, triton_store: bool = True) -> None:
        self.triton_store = triton_store
        self.cudagraph_support = self.cudagraph_support and triton_store

    def store_kv(self, k, v, kv_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
        if self.triton_store and kv_cache.is_cuda:
            store_kv_triton(k, v, kv_cache, slot_mapping, k_scale, v_scale)
        else:
            super().store_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale)

    def rotate_and_store_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        tables: RopeTables,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> bool:
        if not (self.triton_store and kv_cache.is_cuda):
            return False
        return rotate_and_store_kv(q, k, v, kv_cache, slot_mapping, tables, k_scale, v_scale)
