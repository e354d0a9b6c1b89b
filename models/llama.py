"""Llama-family decoder (Llama 2/3, SmolLM2), tensor parallel.

Qwen2, Qwen3 and Mistral subclass LlamaForCausalLM and change only the switches in
`DecoderOptions` (qkv bias, o_proj bias, per-head q/k norm) and which layers have a
sliding window (`layer_sliding_windows`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attention import Attention
from kernels import KernelSet
from models.causal_lm import CausalLM
from models.cpu_decode_loop import CPUDecodeLoop
from models.layers.activation import get_act_and_mul
from models.layers.embedding import VocabParallelEmbedding
from models.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from models.layers.norm import RMSNorm
from models.layers.rotary import RotaryEmbedding, Rotator, get_head_dim


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
        *,
        scale: float | None = None,
        norm: type[RMSNorm] = RMSNorm,
    ) -> None:
        """`scale`: the attention's (head_dim ** -0.5 unless given); `norm`: the class of
        the q/k norms (options.qk_norm)."""
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
            self.q_norm = norm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = norm(self.head_dim, eps=config.rms_norm_eps)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5 if scale is None else scale,
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
        return self.o_proj(self.attn(q, k, v, rotate=rotate))


class LlamaDecoderLayer(nn.Module):
    """`mlp`: the layer's MLP when it is not the dense one (a mixture of experts)."""

    def __init__(
        self,
        config: Any,
        options: DecoderOptions,
        sliding_window: int | None,
        prefix: str,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(
            config, options, sliding_window, prefix=f"{prefix}.self_attn"
        )
        self.mlp = mlp or LlamaMLP(
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
    def __init__(
        self,
        config: Any,
        options: DecoderOptions,
        sliding_windows: list[int | None],
        prefix: str = "model",
        build_mlp: Callable[[int, str], nn.Module | None] | None = None,
    ) -> None:
        """`build_mlp(layer_index, prefix)`: a layer's MLP when not the dense one."""
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        self.rotary_emb = RotaryEmbedding.from_config(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config,
                options,
                window,
                prefix=f"{prefix}.layers.{i}",
                mlp=build_mlp(i, f"{prefix}.layers.{i}.mlp") if build_mlp else None,
            )
            for i, window in enumerate(sliding_windows)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.decode_loop: CPUDecodeLoop | None = None
        self._loop_kernels: KernelSet | None = None

    def bind_kernels(self, kernels: KernelSet) -> None:
        """The decode loop is built at the next forward: the layers are bound after this."""
        self.decode_loop, self._loop_kernels = None, kernels

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._loop_kernels is not None:
            self.decode_loop = CPUDecodeLoop.build(self, self._loop_kernels, LlamaDecoderLayer)
            self._loop_kernels = None
        hidden_states = self.embed_tokens(input_ids)
        decoded = None if self.decode_loop is None else self.decode_loop(hidden_states, positions)
        if decoded is not None:
            hidden_states, residual = decoded
        else:
            rotate = self.rotary_emb.rotator(positions, hidden_states.dtype)
            residual = None
            for layer in self.layers:
                hidden_states, residual = layer(hidden_states, residual, rotate)
        hidden_states, _ = self.norm(hidden_states, residual, in_place=True)
        return hidden_states


class LlamaForCausalLM(CausalLM):
    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )

    @classmethod
    def layer_sliding_windows(cls, config: Any) -> list[int | None]:
        return [layer_sliding_window(config, i) for i in range(config.num_hidden_layers)]

    def build_model(self, config: Any) -> LlamaModel:
        return LlamaModel(
            config,
            self.decoder_options(config),
            self.layer_sliding_windows(config),
            prefix="model",
            build_mlp=self.build_mlp,
        )

    def build_mlp(self, layer_index: int, prefix: str) -> nn.Module | None:
        """A layer's MLP when it is not the dense one (mixture-of-experts models)."""
        return None
