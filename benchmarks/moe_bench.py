"""The fused-experts kernel (models/layers/cpu_moe.cpp) against torch, kernel level, on a
Qwen3-MoE-like layer: hidden 1024, 64 experts, top-8, expert intermediate 256.

Prefill (--prefill tokens, default 512): GFLOP/s of the kernel and of fused_experts_torch,
against torch's dense matmul of the same FLOPs (x of all T * k pairs times gate/up, SiLU,
times down: one expert holding every pair) and the kernel's share of that rate. Decode
(--decode tokens, default 1 16 64): ms per call of the kernel, of fused_experts_torch and of
a naive loop over all experts (transformers' Mixtral style: torch.where per expert). Each
call routes afresh (random experts), so that the experts' weights (96 MB bf16, 192 MB
float32) come from memory, as in a decode step, not from the cache.

    python -m benchmarks.moe_bench [--threads 2] [--dtype bfloat16 float32]
"""

from __future__ import annotations

import argparse
import subprocess

import torch
import torch.nn.functional as F

from benchmarks.quant_linear_bench import seconds_per_call
from kernels import KernelSet
from models.layers.moe_experts import fused_experts, fused_experts_torch, moe_kernel

HIDDEN, EXPERTS, TOP_K, INTER = 1024, 64, 8, 256


def routings(tokens: int, count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` random routings: TOP_K distinct experts per token, softmax weights."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.rand(tokens, EXPERTS, generator=g).argsort(dim=1)[:, :TOP_K]
        out.append((torch.rand(tokens, TOP_K, generator=g).softmax(dim=1), ids))
    return out


def naive_experts(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Every expert in turn: its tokens by torch.where, its MLP, added in x's dtype."""
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        rows, slots = torch.where(topk_ids == e)
        if rows.numel() == 0:
            continue
        gate, up = F.linear(x[rows], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * topk_weights[rows, slots, None].to(x.dtype)
        out.index_add_(0, rows, y)
    return out


def prefill(kernels: KernelSet, dtype: torch.dtype, tokens: int, w13, w2, repeats: int) -> None:
    x = torch.randn(tokens, HIDDEN).to(dtype)
    weights, ids = routings(tokens, 1)[0]
    pairs = tokens * TOP_K
    flops = pairs * (2 * HIDDEN * 2 * INTER + 2 * INTER * HIDDEN)
    xs = torch.randn(pairs, HIDDEN).to(dtype)
    w13_all, w2_all = w13[0], w2[0]

    def dense() -> torch.Tensor:
        gate, up = F.linear(xs, w13_all).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w2_all)

    runs = {
        "kernel": lambda: fused_experts(x, w13, w2, weights, ids, kernels),
        "torch path": lambda: fused_experts_torch(x, w13, w2, weights, ids),
        "dense matmul": dense,
    }
    rates = {k: flops / seconds_per_call([f], repeats) / 1e9 for k, f in runs.items()}
    cells = "  ".join(f"{k} {v:6.1f}" for k, v in rates.items())
    share = rates["kernel"] / rates["dense matmul"]
    print(f"prefill T={tokens} {str(dtype)[6:]:8s} GFLOP/s: {cells}  kernel/dense {share:.2f}")


def decode(kernels: KernelSet, dtype: torch.dtype, tokens: int, w13, w2, repeats: int) -> None:
    x = torch.randn(tokens, HIDDEN).to(dtype)
    routes = routings(tokens, 16, seed=tokens)
    ways = {
        "kernel": lambda *a: fused_experts(*a, kernels=kernels),
        "torch path": fused_experts_torch,
        "naive loop": naive_experts,
    }
    times = {
        name: seconds_per_call([lambda f=f, r=r: f(x, w13, w2, *r) for r in routes], repeats)
        for name, f in ways.items()
    }
    cells = "  ".join(f"{k} {v * 1e3:7.3f}" for k, v in times.items())
    speedup = min(t for k, t in times.items() if k != "kernel") / times["kernel"]
    print(f"decode  T={tokens:<3d} {str(dtype)[6:]:8s} ms/call: {cells}  kernel x{speedup:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--prefill", type=int, nargs="*", default=[512])
    parser.add_argument("--decode", type=int, nargs="*", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kernels = KernelSet(cpu=True)
    assert moe_kernel(kernels) is not None, "the C++ kernel did not build"
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line for line in cpu.splitlines() if "Model name" in line), "Model name: ?")
    print(f"{' '.join(model.split())}; isa {kernels.isa}, {args.threads} threads, torch "
          f"{torch.__version__}; H={HIDDEN} E={EXPERTS} top-{TOP_K} I={INTER}")  # fmt: skip
    for name in args.dtype:
        dtype = getattr(torch, name)
        w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN) / HIDDEN**0.5).to(dtype)
        w2 = (torch.randn(EXPERTS, HIDDEN, INTER) / INTER**0.5).to(dtype)
        for tokens in args.prefill:
            prefill(kernels, dtype, tokens, w13, w2, args.repeats)
        for tokens in args.decode:
            decode(kernels, dtype, tokens, w13, w2, args.repeats)


if __name__ == "__main__":
    main()
