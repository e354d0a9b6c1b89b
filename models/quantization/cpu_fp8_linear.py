"""fp8 weight-only linear layers on CPU: the C++ kernel (cpu_fp8_linear.cpp) and the torch
path it matches (dequantize per call, then F.linear).

A batch of up to SMALL_BATCH_ROWS rows runs through the kernel, which reads each weight
byte once and computes in float32; a larger one has the kernel dequantize the weight to
the activations' dtype for a matmul, where the matmul's arithmetic is the cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from kernels import KernelSet
from kernels.libraries import FP8_LINEAR

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
SMALL_BATCH_ROWS = 16


@dataclass(frozen=True)
class Fp8Weight:
    """w[n, k] = scale[n] * weight[n, k]: `weight` float8_e4m3fn [N, K] (rows dense),
    `scale` float32 [N]."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.weight.dtype != FP8_DTYPE or self.weight.dim() != 2:
            raise ValueError(f"fp8 weight must be float8_e4m3fn [N, K], got {self.weight.dtype}")
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != self.weight.shape[:1]:
            raise ValueError(f"fp8 scale must be float32 [{self.weight.shape[0]}]")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The logical weight [N, K] (computed in float32, then cast)."""
        return (self.weight.float() * self.scale[:, None]).to(dtype)


def quantize_fp8_per_channel(weight: torch.Tensor) -> Fp8Weight:
    """e4m3 with scale max|row| / 448 per output feature (round to nearest)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(q, scale)


@dataclass(frozen=True)
class PreparedFp8Weight:
    """The weight with the kernel that computes on it (None: the torch path)."""

    weight: Fp8Weight
    kernel: ModuleType | None


def fp8_kernel(kernels: KernelSet) -> ModuleType | None:
    return kernels.cpp(FP8_LINEAR)


def prepare_fp8_weight(w: Fp8Weight, kernels: KernelSet) -> PreparedFp8Weight:
    on_cpu = w.weight.device.type == "cpu"
    return PreparedFp8Weight(w, fp8_kernel(kernels) if on_cpu else None)


def torch_fp8_linear(
    x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, w.dequantize(x.dtype), bias)


def fp8_linear(
    x: torch.Tensor, prepared: PreparedFp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (scale * W)^T (+ bias), in x's dtype."""
    kernel, w = prepared.kernel, prepared.weight
    if kernel is None:
        return torch_fp8_linear(x, w, bias)
    rows = x.reshape(-1, x.shape[-1])
    weight_bytes = w.weight.view(torch.uint8)
    if rows.shape[0] <= SMALL_BATCH_ROWS:
        out = kernel.linear(rows, weight_bytes, w.scale, bias)
    else:
        out = F.linear(rows, kernel.dequantize(weight_bytes, w.scale, x.dtype), bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])
