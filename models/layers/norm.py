"""RMSNorm, computed in float32 as transformers does, with a fused residual add.

On CPU tensors the fused C++ kernel (cpu_ops.cpp) does it in one pass per row, on CUDA
tensors the Triton kernel (triton_ops.py); the torch code is the fallback and the reference
they match (the C++ kernel bitwise). GemmaRMSNorm is Gemma's variant (weight stored as an
offset from 1, applied in float32), torch only.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from models.layers import triton_ops
from models.layers.cpu_ops import cpu_kernels, fits_rows
from models.layers.utils import default_weight_loader, new_parameter, set_weight_attrs


class RMSNorm(nn.Module):
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
        ops = self._kernels(x) if residual is None else self._kernels(x, residual)
        if ops is None:
            return self.forward_torch(x, residual)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.variance_epsilon)
        if in_place:
            out, total = x, residual
        else:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
            total = torch.empty_like(out)
        ops.add_rms_norm(x, residual, self.weight, self.variance_epsilon, out, total)
        return out, total

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

    def _kernels(self, x: torch.Tensor, *others: torch.Tensor) -> ModuleType | None:
        """The CPU or the Triton kernels when they take these tensors, else None."""
        if x.is_cuda:
            fits = triton_ops.norm_fits(x, self.weight, *others)
            return triton_ops.triton_kernels(x.device, x.dtype) if fits else None
        ops = cpu_kernels(x.device, x.dtype)
        if ops is None or self.weight.dtype != x.dtype or not fits_rows(x):
            return None
        if any(t.shape != x.shape or t.dtype != x.dtype or not fits_rows(t) for t in others):
            return None
        return ops


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32, then cast back (Gemma's RMSNorm: the
    weight multiplies before the cast, unlike Llama's). With `residual`:
    (norm(x + residual), x + residual), the sum in x's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = new_parameter(hidden_size)
        with torch.no_grad():
            self.weight.zero_()
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)
