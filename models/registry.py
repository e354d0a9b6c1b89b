"""Model classes by Hugging Face `config.architectures` name."""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from torch import nn

# architecture name -> (module, class name); imported lazily.
_MODELS: dict[str, tuple[str, str]] = {
    "Gemma3ForCausalLM": ("models.gemma3", "Gemma3ForCausalLM"),
    "LlamaForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("models.mistral", "MistralForCausalLM"),
    "MixtralForCausalLM": ("models.moe", "MixtralForCausalLM"),
    "Qwen2ForCausalLM": ("models.qwen2", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("models.moe", "Qwen2MoeForCausalLM"),
    "Qwen3ForCausalLM": ("models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("models.moe", "Qwen3MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architectures: Sequence[str] | str | None) -> type[nn.Module]:
    """The class for the first supported name in `architectures` (config.architectures)."""
    if isinstance(architectures, str):
        architectures = [architectures]
    for arch in architectures or []:
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            return getattr(importlib.import_module(module_name), class_name)
    raise ValueError(
        f"unsupported model architecture {list(architectures or [])}; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )
