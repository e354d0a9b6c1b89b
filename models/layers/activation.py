"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.layers import triton_ops
from models.layers.cpu_ops import cpu_kernels, fits_rows


class SiluAndMul(nn.Module):
    """x = [gate; up] along the last dim -> silu(gate) * up (the C++ kernel on CPU, the
    Triton kernel on CUDA)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            ops = triton_ops.triton_kernels(x.device, x.dtype) if triton_ops.rows_fit(x) else None
        else:
            ops = cpu_kernels(x.device, x.dtype) if fits_rows(x) else None
        if ops is None or x.shape[-1] % 2:
            return self.forward_torch(x)
        return ops.silu_and_mul(x)

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
