"""A linear kernel's output against the float64 product."""

from __future__ import annotations

import torch


def check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None):
    """Within float32 summation error of the exact product; a bf16 result within one
    rounding of it (8 significant bits)."""
    exact = x.double() @ w.double().t()
    if bias is not None:
        exact += bias.double()
    scale = x.double().abs() @ w.double().abs().t() + 1e-30
    error = (out.double() - exact).abs()
    assert out.dtype == x.dtype and out.shape == exact.shape
    bound = scale * 1e-5 + (exact.abs() * 2**-7 if x.dtype == torch.bfloat16 else 0)
    assert (error <= bound).all(), (error - bound).max()
