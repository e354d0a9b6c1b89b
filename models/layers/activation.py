"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.cpu_ops import cpu_kernels, fits_rows


class SiluAndMul(nn.Module):
    """x = [gate; up] along the last dim -> silu(gate) * up (the C++ kernel on CPU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cpu_kernels(x.device, x.dtype)
        if ops is None or not fits_rows(x):
            return self.forward_torch(x)
        return ops.silu_and_mul(x)

    @staticmethod
    def forward_torch(x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


def get_act_and_mul(hidden_act: str) -> nn.Module:
    if hidden_act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {hidden_act!r} (only silu is implemented)")
    return SiluAndMul()
