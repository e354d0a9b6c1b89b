"""Quantized weights: the formats, their kernels and the per-layer quantization methods.

`get_quantization_config(method, hf_config)` gives the QuantizationConfig of a
--quantization value (ipc.config.QUANTIZATION_METHODS); each method's module is imported
only when a model uses it.
"""

from __future__ import annotations

import importlib
from typing import Any

from models.quantization.base_config import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    building_with,
    current_quant_config,
)

# --quantization value -> "module:QuantizationConfig subclass".
_CONFIGS: dict[str, str] = {
    "awq": "models.quantization.awq:AWQConfig",
    "compressed-tensors": "models.quantization.compressed_tensors:CompressedTensorsConfig",
    "fp8": "models.quantization.fp8:Fp8Config",
    "gguf": "models.quantization.gguf:GGUFConfig",
    "gptq": "models.quantization.gptq:GPTQConfig",
    "int8": "models.quantization.int8:Int8Config",
}


def get_quantization_config(method: str | None, hf_config: Any) -> QuantizationConfig | None:
    """The config for `method` (None: an unquantized model), built from the checkpoint's
    quantization_config where it has one."""
    if method is None:
        return None
    if method not in _CONFIGS:
        raise ValueError(f"quantization {method!r} is not implemented in this build")
    module, name = _CONFIGS[method].split(":")
    config_cls = getattr(importlib.import_module(module), name)
    checkpoint = getattr(hf_config, "quantization_config", None) or {}
    if not isinstance(checkpoint, dict):
        checkpoint = checkpoint.to_dict()
    return config_cls.from_config(checkpoint)


__all__ = [
    "LinearMethodBase",
    "QuantizationConfig",
    "QuantizeMethodBase",
    "building_with",
    "current_quant_config",
    "get_quantization_config",
]
