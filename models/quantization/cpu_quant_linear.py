"""Placeholder until the C++ kernel lands: the torch path (dequantize per call)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import KernelSet
from models.quantization.block_quant import BlockQuantWeight

PreparedQuantWeight = BlockQuantWeight


def prepare_quant_weight(w: BlockQuantWeight, kernels: KernelSet) -> PreparedQuantWeight:
    return w


def torch_quant_linear(
    x: torch.Tensor, w: BlockQuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, w.dequantize(x.dtype), bias)


def quant_linear(
    x: torch.Tensor, w: PreparedQuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return torch_quant_linear(x, w, bias)
