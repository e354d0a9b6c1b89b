"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """x = [gate; up] along the last dim -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


def get_act_and_mul(hidden_act: str) -> nn.Module:
    if hidden_act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {hidden_act!r} (only silu is implemented)")
    return SiluAndMul()
