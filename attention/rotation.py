"""The rotary embedding as the attention layer sees it: a rotation of q and k it applies
before storing k, and the tables that let it rotate q and k in the store-KV kernel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class RopeTables:
    """Neox rotary at one forward pass's positions, as the fused rotary + store-KV kernel
    reads it: positions [T] (integers, contiguous, on the device), cos/sin caches
    [max_position, head_dim // 2] (float32, contiguous; rows are looked up by position),
    and the dtype of the q and k it rotates (cos/sin are rounded to it).

    Every tensor lives as long as the model (or the step's input buffers), so a captured
    CUDA graph may replay a launch that reads them."""

    positions: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    dtype: torch.dtype

    @property
    def head_dim(self) -> int:
        return 2 * self.cos_cache.shape[1]


class Rotation(Protocol):
    """rotate(q, k) -> (q, k) rotated (perhaps in place): q [T, heads * head_dim], k
    [T, kv_heads * head_dim]. `rope_tables` is not None where the rotation is one the
    fused kernel can apply instead (CUDA tensors, Triton kernels enabled)."""

    @property
    def rope_tables(self) -> RopeTables | None: ...

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
