"""Gemma 3 text decoder (transformers' Gemma3ForCausalLM, model_type "gemma3_text"),
tensor parallel.

Differences from Llama: the embedding is scaled by sqrt(hidden_size) in the model dtype;
every RMSNorm is Gemma's (1 + weight, float32); q and k get a per-head RMSNorm; four norms
per layer (around both attention and MLP); a gelu-tanh gated MLP; attention scale
query_pre_attn_scalar ** -0.5; local (sliding window) and global layers, each kind with
its own rotary embedding; optional final logit softcapping; tied embeddings.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.causal_lm import CausalLM
from models.layers.embedding import VocabParallelEmbedding
from models.layers.norm import GemmaRMSNorm
from models.layers.rotary import RotaryEmbedding, Rotator
from models.llama import DecoderOptions, LlamaAttention, LlamaMLP

SLIDING, FULL = "sliding_attention", "full_attention"


def gemma3_layer_types(config: Any) -> list[str]:
    """config.layer_types, or for older configs every `sliding_window_pattern`-th layer
    global and the rest local (pattern 6 if unset), as transformers derives it."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return list(layer_types)
    pattern = getattr(config, "sliding_window_pattern", None) or 6
    return [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]


def _window(config: Any, layer_type: str) -> int | None:
    return (getattr(config, "sliding_window", None) or None) if layer_type == SLIDING else None


class Gemma3Attention(LlamaAttention):
    """Llama's attention with q/k norms always on, Gemma's norm and Gemma's scale."""

    def __init__(self, config: Any, sliding_window: int | None, prefix: str) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(
            config,
            DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True),
            sliding_window,
            prefix,
            scale=config.query_pre_attn_scalar**-0.5,
            norm=GemmaRMSNorm,
        )


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_type: str, prefix: str) -> None:
        super().__init__()
        self.is_sliding = layer_type == SLIDING
        self.self_attn = Gemma3Attention(
            config, _window(config, layer_type), prefix=f"{prefix}.self_attn"
        )
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_activation,
            bias=False,
            prefix=f"{prefix}.mlp",
        )
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps=eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps=eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps=eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps=eps)

    def forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None, rotate: Rotator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual stream): the caller adds the two (in the next layer's
        input norm, or the final norm)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(hidden_states, rotate))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


class Gemma3Model(nn.Module):
    def __init__(self, config: Any, prefix: str = "model") -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        # float32 here, cast to the activations' dtype in forward (as transformers does:
        # in bfloat16, sqrt(hidden_size) is rounded before it scales).
        self.register_buffer(
            "embed_scale",
            torch.tensor(config.hidden_size**0.5, dtype=torch.float32),
            persistent=False,
        )
        self.rotary_local = RotaryEmbedding.from_config(config, SLIDING)
        self.rotary_global = RotaryEmbedding.from_config(config, FULL)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, layer_type, prefix=f"{prefix}.layers.{i}")
            for i, layer_type in enumerate(gemma3_layer_types(config))
        )
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        hidden_states = hidden_states * self.embed_scale.to(hidden_states.dtype)
        rotate_local = self.rotary_local.rotator(positions, hidden_states.dtype)
        rotate_global = self.rotary_global.rotator(positions, hidden_states.dtype)
        residual = None
        for layer in self.layers:
            rotate = rotate_local if layer.is_sliding else rotate_global
            hidden_states, residual = layer(hidden_states, residual, rotate)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Gemma3ForCausalLM(CausalLM):
    @classmethod
    def layer_sliding_windows(cls, config: Any) -> list[int | None]:
        return [_window(config, layer_type) for layer_type in gemma3_layer_types(config)]

    def build_model(self, config: Any) -> Gemma3Model:
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise NotImplementedError("Gemma 3 attention logit softcapping is not supported")
        if getattr(config, "use_bidirectional_attention", False):
            raise NotImplementedError("Gemma 3 bidirectional attention is not supported")
        return Gemma3Model(config, prefix="model")

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits.float() / cap) * cap
        return logits
