"""--quantization int8: a 16/32-bit checkpoint quantized at load, weight-only, to int8
with one symmetric scale per output channel (a BlockQuantWeight whose block is the whole
row), computed on by the block-quantized kernels."""

from __future__ import annotations

import torch
from torch import nn

from kernels import KernelSet
from models.layers.linear import LinearBase, UnquantizedLinearMethod
from models.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from models.quantization.block_quant import BlockQuantWeight
from models.quantization.cpu_quant_linear import (
    PreparedQuantWeight,
    prepare_quant_weight,
    quant_linear,
)


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


class Int8Config(QuantizationConfig):
    name = "int8"

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        return Int8LinearMethod() if isinstance(layer, LinearBase) else None
