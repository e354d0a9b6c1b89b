"""RMSNorm, computed in float32 as transformers does, with a fused residual add.

With the kernel set's fused kernels (fused_ops.py: C++ on the CPU, Triton on CUDA) it runs
in one pass per row; the torch code is the fallback and the reference they match (the C++
kernel bitwise). GemmaRMSNorm is Gemma's variant (weight stored as an offset from 1,
applied in float32), torch only.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from kernels import KernelSet
from models.layers.fused_ops import fused_ops
from models.layers.utils import default_weight_loader, new_parameter, set_weight_attrs


class RMSNorm(nn.Module):
    ops: ModuleType | None = None  # the fused kernels (bind_kernels); None: torch code

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = new_parameter(hidden_size)
        with torch.no_grad():
            self.weight.fill_(1.0)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, *, in_place: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with `residual`: (norm(x + residual), x + residual). With in_place,
        the kernel writes these two into x and residual and returns them (as vLLM's
        fused_add_rms_norm): the caller gives both up."""
        ops = self.ops
        if ops is None:
            return self.forward_torch(x, residual)
        if residual is None:
            out = ops.rms_norm(x, self.weight, self.variance_epsilon)
            return self.forward_torch(x) if out is None else out
        if in_place:
            out, total = x, residual
        else:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
            total = torch.empty_like(out)
        if ops.add_rms_norm(x, residual, self.weight, self.variance_epsilon, out, total):
            return out, total
        return self.forward_torch(x, residual)

    def bind_kernels(self, kernels: KernelSet) -> None:
        self.ops = fused_ops(kernels)

    def forward_torch(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), all in float32, then cast back (Gemma's RMSNorm: the
    weight multiplies before the cast, unlike Llama's). With `residual`:
    (norm(x + residual), x + residual), the sum in x's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        with torch.no_grad():
            self.weight.zero_()

    def bind_kernels(self, kernels: KernelSet) -> None:
        """Torch only: the fused kernels compute Llama's norm."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)
