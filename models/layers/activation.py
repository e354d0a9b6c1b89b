"""Activations."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kernels import KernelSet
from models.layers.fused_ops import fused_ops


class SiluAndMul(nn.Module):
    """x = [gate; up] along the last dim -> silu(gate) * up (the kernel set's fused kernel
    where it takes x, else the torch code)."""

    ops: ModuleType | None = None  # the fused kernels (bind_kernels); None: torch code

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = None if self.ops is None else self.ops.silu_and_mul(x)
        return self.forward_torch(x) if out is None else out

    def bind_kernels(self, kernels: KernelSet) -> None:
        self.ops = fused_ops(kernels)

    @staticmethod
    def forward_torch(x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class GeluTanhAndMul(nn.Module):
    """x = [gate; up] along the last dim -> gelu(gate, tanh approximation) * up
    (transformers' gelu_pytorch_tanh, Gemma's MLP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


_ACT_AND_MUL: dict[str, type[nn.Module]] = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
}


def get_act_and_mul(hidden_act: str) -> nn.Module:
    if hidden_act not in _ACT_AND_MUL:
        raise ValueError(
            f"unsupported hidden_act {hidden_act!r} (supported: {', '.join(_ACT_AND_MUL)})"
        )
    return _ACT_AND_MUL[hidden_act]()
