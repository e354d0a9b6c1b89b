import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from attention.backends.base import AttentionBackend
from attention.forward_context import get_forward_context
from attention.kv_cache_dtype import as_float32_scale
from attention.rotation import Rotation
from attention.spec import AttentionSpec

# Checkpoint tensors that hold a layer's fp8 KV scales, by the end of their names: vLLM's,
# and the older output scales of the k/v projections. `kv_scale_target` maps them.
_KV_SCALE_SUFFIXES = {
    ".attn.k_scale": "k",
    ".attn.v_scale": "v",
    ".k_proj.output_scale": "k",
    ".v_proj.output_scale": "v",
}


def kv_scale_target(name: str) -> tuple[str, str] | None:
    """For a checkpoint tensor that is a KV scale, the name of the Attention module it
    belongs to (vLLM's layout: `<...>.self_attn.attn`) and which scale ("k" or "v");
    None for any other tensor. A model's load_weights hands the tensor to that module's
    `load_kv_scale`."""
    for suffix, which in _KV_SCALE_SUFFIXES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".attn", which
    return None


class Attention(nn.Module):
    """Paged attention over this rank's heads.

    The model runner binds `kv_cache` ([2, num_blocks, block_size, num_kv_heads,
    head_dim]) once the cache is allocated, and `kv_cache_group`, the KV cache group
    whose block ids the layer's pages are addressed by (layers of different groups may
    share one tensor: a block id belongs to one group at a time). In a step, the layer
    rotates q and k by the model's `rotate` (rotary embedding; None: q and k as given),
    has the step's backend write this step's K/V into the cache by its group's slot
    mapping, then the backend attends over the cached context, reading the layer's `spec`.
    Where the rotation offers its tables (`Rotation.rope_tables`) the backend may rotate
    and store in one kernel. q is [T, num_heads * head_dim]; k and v are [T, num_kv_heads
    * head_dim]; the output is [T, num_heads * head_dim]. q and k may be rotated in place.
    An fp8 cache stores K/V divided by the layer's k/v scales (`load_kv_scale`, from the
    checkpoint) and is read times them.
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
        self.spec = AttentionSpec(num_heads, num_kv_heads, head_dim, scale, sliding_window)
        self.prefix = prefix
        self.kv_cache: torch.Tensor | None = None
        self.kv_cache_group = 0

    def load_kv_scale(self, which: str, scale: torch.Tensor | float) -> None:
        """Set the layer's fp8 K ("k") or V ("v") scale from a checkpoint tensor: a scalar,
        or per-head values of which the largest is kept (one scale per layer)."""
        if which not in ("k", "v"):
            raise ValueError(f"KV scale must be 'k' or 'v', got {which!r}")
        value = torch.as_tensor(scale).detach().float().max().item()
        value = as_float32_scale(value, f"{self.prefix or 'attention'}.{which}_scale")
        self.spec = dataclasses.replace(self.spec, **{f"{which}_scale": value})

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotate: Rotation | None = None,
    ) -> torch.Tensor:
        num_tokens, spec = q.shape[0], self.spec
        ctx = get_forward_context()
        md = None if ctx.attn_metadata is None else ctx.attn_metadata[self.kv_cache_group]
        if md is None or self.kv_cache is None:
            if rotate is not None:
                q, k = rotate(q, k)
            q, k, v = self._views(q, k, v)
        else:
            q, k, v = self._rotate_and_store(q, k, v, rotate, ctx.backend, md.slot_mapping)
        if md is None:
            out = self._causal_attention(q, k, v)
        else:
            out = ctx.backend.forward(spec, q, k, v, self.kv_cache, md)
        return out.reshape(num_tokens, spec.num_heads * spec.head_size)

    def _rotate_and_store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotate: Rotation | None,
        backend: AttentionBackend,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated) and v as [T, heads, head_dim], k and v written into the cache at
        the slot mapping: in one kernel where the backend has one that takes them, else
        rotation, then the backend's store."""
        tables = rotate.rope_tables if rotate is not None else None
        if tables is not None:
            views = self._views(q, k, v)
            scales = (self.spec.k_scale, self.spec.v_scale)
            if backend.rotate_and_store_kv(*views, self.kv_cache, slot_mapping, tables, *scales):
                return views
        if rotate is not None:
            q, k = rotate(q, k)
        q, k, v = self._views(q, k, v)
        backend.store_kv(k, v, self.kv_cache, slot_mapping, self.spec.k_scale, self.spec.v_scale)
        return q, k, v

    def _views(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens, spec = q.shape[0], self.spec
        return (
            q.view(num_tokens, spec.num_heads, spec.head_size),
            k.view(num_tokens, spec.num_kv_heads, spec.head_size),
            v.view(num_tokens, spec.num_kv_heads, spec.head_size),
        )

    def _causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """All tokens as one sequence, no cache: the profiling run and model unit tests."""
        n = q.shape[0]
        mask, window = None, self.spec.sliding_window
        if window is not None:
            pos = torch.arange(n, device=q.device)
            dist = pos[:, None] - pos[None, :]
            mask = (dist >= 0) & (dist < window)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.spec.scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)
