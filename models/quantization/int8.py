"""--quantization int8: a 16/32-bit checkpoint quantized at load, weight-only, to int8
with one symmetric scale per output channel (a BlockQuantWeight whose block is the whole
row), computed on by the block-quantized kernels; a mixture of experts' experts too."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels import KernelSet
from models.layers.fused_moe import FusedMoE
from models.layers.linear import LinearBase, UnquantizedLinearMethod
from models.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from models.quantization.block_quant import BlockQuantWeight
from models.quantization.cpu_quant_linear import (
    PreparedQuantWeight,
    prepare_quant_weight,
    quant_linear,
)
from models.quantization.quant_moe import BlockQuantMoEMethod


def quantize_per_channel_int8(weight: torch.Tensor) -> BlockQuantWeight:
    """Round-to-nearest int8 with scale max|row| / 127 per output feature."""
    w = weight.float()
    scales = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales).clamp_(-127, 127).to(torch.int8)
    return BlockQuantWeight(8, q, scales, None, w.shape[1])


class Int8LinearMethod(UnquantizedLinearMethod):
    """Loads the dense weight as the unquantized method does, then quantizes it."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = quantize_per_channel_int8(layer.weight.data)
        del layer.weight
        layer.prepared_weight = PreparedQuantWeight(weight, None)

    def bind_kernels(self, layer: nn.Module, kernels: KernelSet) -> None:
        layer.prepared_weight = prepare_quant_weight(layer.prepared_weight, kernels)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return quant_linear(x, layer.prepared_weight, bias)

    def decode_weight(self, layer: nn.Module) -> PreparedQuantWeight:
        return layer.prepared_weight


class Int8MoEMethod(BlockQuantMoEMethod):
    """Each expert's projections quantized as they load, as Int8LinearMethod's weights."""

    def to_part(self, layer: nn.Module, projection: str, loaded: Any) -> BlockQuantWeight:
        if not isinstance(loaded, torch.Tensor):
            raise ValueError(f"{layer.prefix}: int8 quantizes 16/32-bit experts, got {loaded!r}")
        return quantize_per_channel_int8(loaded)


class Int8Config(QuantizationConfig):
    name = "int8"

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, FusedMoE):
            return Int8MoEMethod()
        return Int8LinearMethod() if isinstance(layer, LinearBase) else None
