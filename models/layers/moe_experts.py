"""The experts of a mixture-of-experts layer, fused: each token's top-k experts' SwiGLU
MLPs, weighted by the router and summed.

    out[t] = sum_j topk_weights[t, j] * (w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])))

with e = topk_ids[t, j]. An id below 0 names an expert that is not on this rank (expert
parallelism): that (t, j) adds nothing. `fused_experts` runs the C++ kernel on CPU tensors
when the kernel set has it built, else `fused_experts_torch`, the fallback (CPU and CUDA)
and the reference the kernel is tested against. The kernel (cpu_moe.cpp) keeps a float32
workspace of up to 32 MB in each thread that calls it, and runs longer batches in chunks.
"""

from __future__ import annotations

from functools import cache
from types import ModuleType
from typing import Protocol

import torch
import torch.nn.functional as F

from kernels import KernelSet
from kernels.libraries import MOE


@cache
def moe_kernel(kernels: KernelSet) -> ModuleType | None:
    """The compiled fused-experts kernel for the set's ISA (looked up once per set); None
    where the C++ kernels are off or cannot be built."""
    return kernels.cpp(MOE)


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    kernels: KernelSet | None = None,
) -> torch.Tensor:
    """The experts' weighted sum for each token of x [T, H] (module docstring), in x's
    dtype. w13 [E, 2I, H] holds each expert's gate rows then its up rows, w2 [E, H, I];
    topk_weights [T, k] float32, topk_ids [T, k] int64 (< 0: not on this rank)."""
    if kernels is not None and x.device.type == "cpu":
        module = moe_kernel(kernels)
        if module is not None:
            out = module.fused_experts(x, w13, w2, topk_weights, topk_ids)
            if out is not None:  # None: a dtype or layout the kernel does not take
                return out
    return fused_experts_torch(x, w13, w2, topk_weights, topk_ids)


class ExpertWeights(Protocol):
    """Experts held otherwise than as one tensor (quantized: models/quantization/quant_moe.py)."""

    def linear(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [rows, K] times expert's weight [N, K]^T, in x's dtype."""


def _linear(w: torch.Tensor | ExpertWeights, expert: int, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w[expert]) if isinstance(w, torch.Tensor) else w.linear(expert, x)


def fused_experts_torch(
    x: torch.Tensor,
    w13: torch.Tensor | ExpertWeights,
    w2: torch.Tensor | ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int | None = None,
) -> torch.Tensor:
    """`fused_experts` in torch: the (token, slot) pairs sorted by expert, one gate/up and
    one down matmul (in x's dtype) per expert that has pairs, SiLU(gate) * up in float32,
    and the weighted rows added into a float32 sum (index_add_), rounded once to x's dtype.
    Reads the experts' pair counts to the host once (a sync on CUDA). Experts held as
    ExpertWeights take `num_experts`."""
    num_tokens, hidden = x.shape
    if num_experts is None:
        num_experts = w13.shape[0]
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    if num_tokens == 0 or topk_ids.numel() == 0:
        return out.to(x.dtype)
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # ids < 0 first: they are skipped
    # counts[0]: pairs with no expert on this rank; counts[1 + e]: expert e's pairs.
    counts = torch.bincount(flat_ids.clamp(min=-1) + 1, minlength=num_experts + 1).tolist()
    if len(counts) > num_experts + 1:
        raise ValueError(f"topk_ids names an expert >= {num_experts}, the experts held")
    tokens = order // top_k
    weights = topk_weights.reshape(-1)[order].to(torch.float32)
    start = counts[0]
    for expert, count in enumerate(counts[1:]):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        gate_up = _linear(w13, expert, x[rows]).float()
        inter = gate_up.shape[1] // 2
        h = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
        y = _linear(w2, expert, h).float() * weights[start : start + count, None]
        out.index_add_(0, rows, y)
        start += count
    return out.to(x.dtype)
