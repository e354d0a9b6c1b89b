"""Qwen3: Llama with RMSNorm over each q/k head (before rotary), no q/k/v bias unless
config.attention_bias, and optional sliding-window layers."""

from __future__ import annotations

from typing import Any

from models.llama import DecoderOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=False, qk_norm=True
        )
