"""Model definitions (Llama, Qwen2, Qwen3, Mistral, Gemma 3), tensor-parallel layers and loading.

from models import load_model, resolve_dtype, kv_cache_shape_info
model = load_model(path, torch.bfloat16, "cpu")
hidden = model(input_ids, positions)          # [T, hidden_size]
logits = model.compute_logits(hidden[last])   # float32 [N, vocab_size]
"""

from __future__ import annotations

from models.loader import (
    kv_cache_shape_info,
    layer_sliding_windows,
    load_config,
    load_model,
    resolve_dtype,
)
from models.registry import get_model_class, supported_architectures

__all__ = [
    "default_model_path",
    "get_model_class",
    "kv_cache_shape_info",
    "layer_sliding_windows",
    "load_config",
    "load_model",
    "resolve_dtype",
    "supported_architectures",
]


def default_model_path() -> str:
    from models.default import default_model_path as _default_model_path

    return _default_model_path()
