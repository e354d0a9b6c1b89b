"""Qwen2: Llama with a q/k/v bias (no o_proj bias) and optional sliding-window layers."""

from __future__ import annotations

from typing import Any

from models.llama import DecoderOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True, o_bias=False, mlp_bias=False)
