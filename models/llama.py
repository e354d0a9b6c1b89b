"""Llama-family decoder (Llama 2/3, SmolLM2), tensor parallel.

Qwen2 and Qwen3 subclass LlamaForCausalLM and change only the switches in
`DecoderOptions` (qkv bias, o_proj bias, per-head q/k norm, sliding windows).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attention import Attention
from models.layers.activation import get_act_and_mul
from models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from models.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from models.layers.norm import RMSNorm
from models.layers.rotary import RotaryEmbedding, Rotator, get_head_dim
from models.layers.utils import default_weight_loader


@dataclass(frozen=True)
class DecoderOptions:
    """What differs between the Llama-style architectures."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each q/k head before rotary


def layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    """The sliding window of layer `layer_idx` as transformers decides it (Qwen2/Qwen3):
    `layer_types[i] == "sliding_attention"`, or with no layer_types,
    `use_sliding_window and i >= max_window_layers`."""
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", False):
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    max_window_layers = getattr(config, "max_window_layers", 0) or 0
    return window if layer_idx >= max_window_layers else None


class LlamaMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool, prefix: str
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = get_act_and_mul(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        options: DecoderOptions,
        sliding_window: int | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.head_dim = get_head_dim(config)
        total_num_kv_heads = getattr(config, "num_key_value_heads", None) or (
            config.num_attention_heads
        )
        self.qkv_proj = QKVParallelLinear(
            self.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            total_num_kv_heads,
            bias=options.qkv_bias,
            prefix=f"{prefix}.qkv_proj",
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            self.hidden_size,
            bias=options.o_bias,
            prefix=f"{prefix}.o_proj",
        )
        self.qk_norm = options.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            sliding_window=sliding_window,
            prefix=f"{prefix}.attn",
        )

    def forward(self, hidden_states: torch.Tensor, rotate: Rotator) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            n = q.shape[0]
            q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim)).reshape(n, self.q_size)
            k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim)).reshape(n, self.kv_size)
        q, k = rotate(q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, options: DecoderOptions, layer_idx: int, prefix: str) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(
            config, options, layer_sliding_window(config, layer_idx), prefix=f"{prefix}.self_attn"
        )
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=options.mlp_bias,
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        rotate: Rotator,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual, in_place=True)
        hidden_states = self.self_attn(hidden_states, rotate)
        hidden_states, residual = self.post_attention_layernorm(
            hidden_states, residual, in_place=True
        )
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, options: DecoderOptions, prefix: str = "model") -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        self.rotary_emb = RotaryEmbedding.from_config(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, options, i, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        rotate = self.rotary_emb.rotator(positions, hidden_states.dtype)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, rotate)
        hidden_states, _ = self.norm(hidden_states, residual, in_place=True)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """model(input_ids [T], positions [T]) -> hidden [T, hidden_size];
    compute_logits(hidden [N, hidden_size]) -> float32 logits [N, vocab_size] on every rank.
    """

    # HF checkpoint projections that are fused here: (fused param, HF name, shard id).
    stacked_params_mapping: tuple[tuple[str, str, str | int], ...] = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )
    # Checkpoint tensors that are not parameters here.
    skipped_weight_suffixes: tuple[str, ...] = (
        "rotary_emb.inv_freq",
        "rotary_emb.cos_cached",
        "rotary_emb.sin_cached",
    )

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.decoder_options(config), prefix="model")
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def attention_layers(self) -> list[Attention]:
        """This rank's Attention modules in layer order (the runner binds `kv_cache`)."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load HF-named checkpoint tensors (or lazy safetensors slices); each parameter
        copies only this rank's shard. Returns the names of the parameters fully loaded
        (a fused parameter once all its shards are)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        expected_shards: dict[str, set[str | int]] = {}
        for param_name, _, shard_id in self.stacked_params_mapping:
            expected_shards.setdefault(param_name, set()).add(shard_id)
        shards_seen: dict[str, set[str | int]] = {}
        for name, weight in weights:
            if name.endswith(self.skipped_weight_suffixes):
                continue
            if self.tie_word_embeddings and name.startswith("lm_head."):
                continue  # shares model.embed_tokens.weight
            for param_name, weight_name, shard_id in self.stacked_params_mapping:
                if f".{weight_name}." not in name:
                    continue
                fused = name.replace(f".{weight_name}.", f".{param_name}.")
                param = self._param(params, fused, name)
                param.weight_loader(param, weight, shard_id)
                shards_seen.setdefault(fused, set()).add(shard_id)
                if shards_seen[fused] >= expected_shards[param_name]:
                    loaded.add(fused)
                break
            else:
                param = self._param(params, name, name)
                getattr(param, "weight_loader", default_weight_loader)(param, weight)
                loaded.add(name)
        return loaded

    @staticmethod
    def _param(params: dict[str, nn.Parameter], name: str, checkpoint_name: str) -> nn.Parameter:
        if name not in params:
            raise KeyError(f"checkpoint tensor {checkpoint_name!r} matches no model parameter")
        return params[name]
