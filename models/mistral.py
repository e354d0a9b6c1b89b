"""Mistral: Llama with `config.sliding_window` on every layer (None: full attention)."""

from __future__ import annotations

from typing import Any

from models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def layer_sliding_windows(cls, config: Any) -> list[int | None]:
        window = getattr(config, "sliding_window", None) or None
        return [window] * config.num_hidden_layers
