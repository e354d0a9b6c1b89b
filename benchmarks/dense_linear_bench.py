"""The dense linear kernel (models/layers/cpu_dense_linear.cpp, CPUs without bf16
instructions) against torch's float32 F.linear, same run: SmolLM2-135M's 30 layers of
qkv, o, gate_up and down weights (each its own tensor, so that they come from memory as in
a step) and its lm_head, for a range of rows. Columns: F.linear on float32 weights (what
`--dtype float32` ran before), the kernel on float32 weights held as its GEMM's panels
(what it runs now, every row count), the kernel on bf16 weights (`--dtype auto` on CPUs
without bf16 instructions: the dot tiles, the row-major panels from 16 rows, the GEMM on
weights packed per call from 768).

    python benchmarks/dense_linear_bench.py [--rows 1 8 16 64 256 2048] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kernels import KernelSet
from models.layers.cpu_linear import PackedWeight, dense_linear_kernel, linear

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
HEAD = (49152, 576)


def timed(fn: Callable[[], object], repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64, 256, 2048])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    kernel = dense_linear_kernel(KernelSet.for_device("cpu"))
    if kernel is None:
        raise SystemExit("no dense kernel here (the CPU has bf16 instructions, or no compiler)")
    torch.manual_seed(0)
    layers = [torch.randn(n, k) / k**0.5 for _ in range(LAYERS) for n, k in SHAPES]
    head = torch.randn(*HEAD) / HEAD[1] ** 0.5
    flops_per_row = 2 * sum(w.numel() for w in layers)
    print(f"threads {torch.get_num_threads()}; ms (GFLOP/s) per run of the 120 layer weights")
    variants = {
        "F.linear f32": lambda w: (w, None),
        "kernel f32": lambda w: (w, PackedWeight(kernel, kernel.pack_weight_panels(w), amx=False)),
        "kernel bf16": lambda w: (w.bfloat16(), PackedWeight(kernel, w.bfloat16(), amx=False)),
    }
    prepared = {name: ([make(w) for w in layers], make(head)) for name, make in variants.items()}
    for rows in args.rows:
        xs = {k: torch.randn(rows, k) for k in {k for _, k in SHAPES}}
        cells = []
        for name, (weights, (hw, hp)) in prepared.items():
            t = timed(lambda ws=weights, xs=xs: [linear(xs[w.shape[1]], w, None, p) for w, p in ws],
                      args.repeat)  # fmt: skip
            h = timed(lambda hw=hw, hp=hp, x=xs[HEAD[1]]: linear(x, hw, None, hp), args.repeat)
            cells.append(f"{name} {t * 1e3:8.1f} ({flops_per_row * rows / t / 1e9:5.1f})"
                         f" head {h * 1e3:6.1f}")  # fmt: skip
        print(f"rows {rows:5d}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
