"""Rotary position embedding (neox style: rotate the two halves of each head).

The inverse frequencies are computed as transformers computes them, for the rope types
default, linear, llama3 and yarn, from `config.rope_parameters` (transformers 5) or
`config.rope_scaling` + `config.rope_theta` (transformers 4). cos/sin for every position
up to max_position_embeddings are cached in float32. A forward pass asks once for
`rotary_emb.rotator(positions, dtype)`, the `Rotator` every layer hands its attention layer
to apply to its q and k: the kernel set's fused kernel (fused_ops.py: C++ on the CPU, Triton
on CUDA), in place, in one pass, where it takes them, else `apply_rotary` with cos/sin
looked up (`get_cos_sin`), the reference the kernels match (the C++ one bitwise). With the
Triton kernels the Rotator also offers its cos/sin tables, so that the attention backend can
rotate q and k in the kernel that stores k and v in the KV cache
(attention/triton_rope_store.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from attention.rotation import RopeTables
from kernels import KernelSet
from models.layers.fused_ops import fused_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

QKRotate = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Rotator:
    """The rotation of q [T, heads * head_dim] and k [T, kv_heads * head_dim] at one forward
    pass's positions, for every layer of the pass (an `attention.Rotation`): rotate(q, k) ->
    (q, k), perhaps in place. `rope_tables` is set where the Triton kernels run, for the
    attention backend's fused rotary + store-KV kernel."""

    apply: QKRotate
    rope_tables: RopeTables | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.apply(q, k)


def get_head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def get_rope_parameters(config: Any, layer_type: str = "full_attention") -> dict[str, Any]:
    """The rope parameters of `layer_type` layers ("full_attention" or "sliding_attention")
    as a flat dict that has rope_type and rope_theta. Only configs with per-layer-type rope
    (Gemma 3) tell the two apart."""
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
        nested = [v for v in params.values() if isinstance(v, dict)]
        if nested:  # per layer type: {"full_attention": {...}, "sliding_attention": {...}}
            params = dict(params.get(layer_type) or params.get("full_attention") or nested[0])
    elif layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None):
        # transformers 4 Gemma 3: local layers use plain rope with their own base.
        params = {"rope_type": "default", "rope_theta": config.rope_local_base_freq}
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    if rope_type in ("llama3", "yarn", "longrope") and not params.get(
        "original_max_position_embeddings"
    ):
        params["original_max_position_embeddings"] = (
            getattr(config, "original_max_position_embeddings", None)
            or config.max_position_embeddings
        )
    return params


def compute_inv_freq(config: Any, layer_type: str = "full_attention") -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [head_dim // 2], attention scaling applied to cos/sin)."""
    params = get_rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None)
    if partial not in (None, 1, 1.0):
        raise NotImplementedError("partial rotary embeddings are not supported")
    base = float(params["rope_theta"])
    dim = get_head_dim(config)

    def default_inv_freq() -> torch.Tensor:
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
        return 1.0 / (base**exponent)

    if rope_type == "default":
        return default_inv_freq(), 1.0
    if rope_type == "linear":
        return default_inv_freq() / params["factor"], 1.0
    if rope_type == "llama3":
        inv_freq = default_inv_freq()
        factor = params["factor"]
        low_freq_factor = params["low_freq_factor"]
        high_freq_factor = params["high_freq_factor"]
        old_context_len = params["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama), 1.0
    return _yarn_inv_freq(config, params, base, dim)


def _yarn_inv_freq(
    config: Any, params: dict[str, Any], base: float, dim: int
) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    original_max = params["original_max_position_embeddings"]
    if factor is None:
        factor = config.max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    mscale = params.get("mscale")
    mscale_all_dim = params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(
                get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            )
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1
    truncate = params.get("truncate", True)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevent a singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_factor)
        + inv_freq_extrapolation * extrapolation_factor
    )
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin cache [max_position, head_dim // 2] (float32) for neox-style rotary."""

    ops: ModuleType | None = None  # the fused kernels (bind_kernels); None: torch code
    offers_tables = False  # whether rotators offer RopeTables (the Triton kernels)

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        inv_freq: torch.Tensor,
        attention_scaling: float = 1.0,
    ) -> None:
        super().__init__()
        assert inv_freq.shape == (head_dim // 2,), "inv_freq must have head_dim // 2 entries"
        self.head_dim = head_dim
        device = torch.get_default_device()
        inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        positions = torch.arange(max_position, device=device, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        self.register_buffer("cos_cache", freqs.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * attention_scaling, persistent=False)

    @classmethod
    def from_config(cls, config: Any, layer_type: str = "full_attention") -> RotaryEmbedding:
        inv_freq, scaling = compute_inv_freq(config, layer_type)
        return cls(get_head_dim(config), config.max_position_embeddings, inv_freq, scaling)

    def get_cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim // 2] in `dtype` for positions [T]."""
        cos = self.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin

    def bind_kernels(self, kernels: KernelSet) -> None:
        self.ops = fused_ops(kernels)
        self.offers_tables = kernels.triton and self.ops is not None

    def rotator(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotator:
        """The rotation of q and k (of `dtype`) at positions [T], for every layer of a pass;
        it may rotate them in place."""
        head_dim, ops = self.head_dim, self.ops
        if ops is None:
            cos, sin = self.get_cos_sin(positions, dtype)

            def rotate(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return apply_rotary(q, cos, sin, head_dim), apply_rotary(k, cos, sin, head_dim)

            return Rotator(rotate)
        positions = positions.long().contiguous()

        def rotate_in_place(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if ops.rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache, head_dim):
                return q, k
            cos, sin = self.get_cos_sin(positions, dtype)
            return apply_rotary(q, cos, sin, head_dim), apply_rotary(k, cos, sin, head_dim)

        tables = None
        if self.offers_tables:
            tables = RopeTables(positions, self.cos_cache, self.sin_cache, dtype)
        return Rotator(rotate_in_place, tables)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """Rotate x [T, heads * head_dim] by cos/sin [T, 1, head_dim // 2] (neox style)."""
    num_tokens = x.shape[0]
    x = x.reshape(num_tokens, -1, head_dim)
    half = head_dim // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.reshape(num_tokens, -1)
