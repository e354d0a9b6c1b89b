import torch
import torch.nn.functional as F
from torch import nn

from attention.forward_context import get_forward_context
from attention.store_kv import store_kv_cache


class Attention(nn.Module):
    """Paged attention over this rank's heads.

    The model runner binds `kv_cache` ([2, num_blocks, block_size, num_kv_heads,
    head_dim]) once the cache is allocated, and `kv_cache_group`, the KV cache group
    whose block ids the layer's pages are addressed by (layers of different groups may
    share one tensor: a block id belongs to one group at a time). In a step, the layer
    writes this step's K/V into the cache by its group's slot mapping, then the step's
    backend attends over the cached context. q is [T, num_heads * head_dim]; k and v
    are [T, num_kv_heads * head_dim]; the output is [T, num_heads * head_dim].
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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        ctx = get_forward_context()
        if ctx.attn_metadata is None:
            out = self._causal_attention(q, k, v)
        else:
            md = ctx.attn_metadata[self.kv_cache_group]
            if self.kv_cache is not None:
                store_kv_cache(k, v, self.kv_cache, md.slot_mapping)
            out = ctx.backend.forward(self, q, k, v, self.kv_cache, md)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

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
