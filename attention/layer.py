import torch
import torch.nn.functional as F
from torch import nn

from attention.forward_context import get_forward_context
from attention.rotation import Rotation
from attention.store_kv import store_kv_cache
from attention.triton_rope_store import rope_store_fits, rotate_and_store_kv


class Attention(nn.Module):
    """Paged attention over this rank's heads.

    The model runner binds `kv_cache` ([2, num_blocks, block_size, num_kv_heads,
    head_dim]) once the cache is allocated, and `kv_cache_group`, the KV cache group
    whose block ids the layer's pages are addressed by (layers of different groups may
    share one tensor: a block id belongs to one group at a time). In a step, the layer
    rotates q and k by the model's `rotate` (rotary embedding; None: q and k as given),
    writes this step's K/V into the cache by its group's slot mapping, then the step's
    backend attends over the cached context. On CUDA the rotation and the store are one
    Triton kernel where the rotation offers its tables (`Rotation.rope_tables`). q is
    [T, num_heads * head_dim]; k and v are [T, num_kv_heads * head_dim]; the output is
    [T, num_heads * head_dim]. q and k may be rotated in place.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.prefix = prefix
        self.kv_cache: torch.Tensor | None = None
        self.kv_cache_group = 0

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotate: Rotation | None = None,
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        ctx = get_forward_context()
        md = None if ctx.attn_metadata is None else ctx.attn_metadata[self.kv_cache_group]
        slot_mapping = None if md is None or self.kv_cache is None else md.slot_mapping
        q, k, v = self._rotate_and_store(q, k, v, rotate, slot_mapping)
        if md is None:
            out = self._causal_attention(q, k, v)
        else:
            out = ctx.backend.forward(self, q, k, v, self.kv_cache, md)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def _rotate_and_store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotate: Rotation | None,
        slot_mapping: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated) and v as [T, heads, head_dim]; given a slot mapping, k and v are
        written into the cache at it: by the fused kernel where it takes them, else
        rotation then store."""
        tables = rotate.rope_tables if rotate is not None else None
        if slot_mapping is not None and tables is not None and self.kv_cache.is_cuda:
            views = self._views(q, k, v)
            if rope_store_fits(*views, self.kv_cache, slot_mapping, tables):
                rotate_and_store_kv(*views, self.kv_cache, slot_mapping, tables)
                return views
        if rotate is not None:
            q, k = rotate(q, k)
        q, k, v = self._views(q, k, v)
        if slot_mapping is not None:
            store_kv_cache(k, v, self.kv_cache, slot_mapping)
        return q, k, v

    def _views(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens = q.shape[0]
        return (
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
        )

    def _causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """All tokens as one sequence, no cache: the profiling run and model unit tests."""
        n = q.shape[0]
        mask = None
        if self.sliding_window is not None:
            pos = torch.arange(n, device=q.device)
            dist = pos[:, None] - pos[None, :]
            mask = (dist >= 0) & (dist < self.sliding_window)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)
