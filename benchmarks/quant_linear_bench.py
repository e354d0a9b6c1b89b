"""Block-quantized linear layers on the CPU (models/quantization/cpu_quant_linear.py)
against dense F.linear (x bf16, or --dtype float32) and the AMX bf16 kernel
(models/layers/cpu_linear.py), same run, on SmolLM2-135M's decode shapes: Q4_1 layers and
the Q8_0 lm_head. Where the build computes on strips, the row kernels run too ("rows").

Each layer is timed over copies of its weight (as many as the model has layers, up to
--copies-mb of bf16 weights), called in turn, so that weights come from memory as in a
decode step rather than from the cache. Weight GB/s counts the bytes each format reads.

    python benchmarks/quant_linear_bench.py [--threads 2] [--rows 1 8 32 64]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import KernelSet
from models.layers.cpu_linear import linear as amx_linear
from models.layers.cpu_linear import pack_weight
from models.quantization.block_quant import BlockQuantWeight, pack_int4
from models.quantization.cpu_quant_linear import (
    PreparedQuantWeight,
    prepare_quant_weight,
    quant_linear,
)
from models.quantization.strips import StripQuantWeight

# (name, N, K, bits, block_size, mins, layers): SmolLM2-135M, gate and up merged.
SHAPES = [
    ("q/o_proj Q4_1", 576, 576, 4, 32, True, 30),
    ("k/v_proj Q4_1", 192, 576, 4, 32, True, 30),
    ("gate_up Q4_1", 3072, 576, 4, 32, True, 30),
    ("down_proj Q4_1", 576, 1536, 4, 32, True, 30),
    ("lm_head Q8_0", 49152, 576, 8, 32, False, 1),
]


def random_weight(n: int, k: int, bits: int, block_size: int, mins: bool) -> BlockQuantWeight:
    blocks = (n, k // block_size)
    scales = (torch.rand(blocks) * 0.01).half()
    offsets = (-torch.rand(blocks) * 0.08).half() if mins else None
    if bits == 4:
        qweight = pack_int4(torch.randint(0, 16, (n, k), dtype=torch.uint8))
    else:
        qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    return BlockQuantWeight(bits, qweight, scales, offsets, block_size)


def quant_bytes(w: BlockQuantWeight) -> int:
    tensors = [w.qweight, w.scales] + ([] if w.mins is None else [w.mins])
    return sum(t.numel() * t.element_size() for t in tensors)


def seconds_per_call(calls: list[Callable[[], object]], repeats: int) -> float:
    """The best over `repeats` passes through `calls` of the mean time of one call: on a
    shared machine other processes only add time."""
    for call in calls:
        call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for call in calls:
            call()
        samples.append((time.perf_counter() - start) / len(calls))
    return min(samples)


def layer_runs(
    x: torch.Tensor, prepared: list, dense: list[torch.Tensor], packed: list
) -> dict[str, list[Callable[[], object]]]:
    """One call per weight copy for each way of computing x W^T."""
    runs = {"quant": [lambda p=p: quant_linear(x, p) for p in prepared]}
    if isinstance(prepared[0].weight, StripQuantWeight):  # the row kernels beside them
        rows = [PreparedQuantWeight(p.row_weight(), p.kernel) for p in prepared]
        runs["rows"] = [lambda p=p: quant_linear(x, p) for p in rows]
    runs["dense"] = [lambda d=d: F.linear(x, d) for d in dense]
    if packed[0] is not None and x.dtype == torch.bfloat16:
        pairs = zip(dense, packed, strict=True)
        runs["amx"] = [lambda d=d, p=p: amx_linear(x, d, packed=p) for d, p in pairs]
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--copies-mb", type=float, default=128.0)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    kernels = KernelSet.for_device("cpu")  # SPLITSERVE_CPU_ISA forces a lower ISA
    print(f"isa {kernels.isa}, {args.threads} threads, x {args.dtype}; us per call, weight GB/s")
    print("columns: quant, [rows: the row kernels, where quant runs on strips], dense F.linear,")
    print("[AMX bf16]; then the speedup of quant over each")
    for name, n, k, bits, block_size, mins, layers in SHAPES:
        copies = max(1, min(layers, int(args.copies_mb * 2**20 // (n * k * 2))))
        quant = [random_weight(n, k, bits, block_size, mins) for _ in range(copies)]
        prepared = [prepare_quant_weight(w, kernels) for w in quant]
        dense = [w.dequantize(dtype) for w in quant]
        packed = [pack_weight(w, kernels) for w in dense]
        for m in args.rows:
            x = torch.randn(m, k).to(dtype)
            runs = layer_runs(x, prepared, dense, packed)
            times = {key: seconds_per_call(calls, args.repeats) for key, calls in runs.items()}
            dense_bytes = n * k * dtype.itemsize
            quant_read = quant_bytes(quant[0])
            nbytes = {"quant": quant_read, "rows": quant_read, "dense": dense_bytes}
            nbytes["amx"] = n * k * 2
            cells = [f"{t * 1e6:8.1f} [{nbytes[key] / t / 1e9:5.1f}]" for key, t in times.items()]
            ratios = " / ".join(
                f"{t / times['quant']:.2f}x" for key, t in times.items() if key != "quant"
            )
            print(f"{name:16} {m:>3}  " + " ".join(f"{c:>16}" for c in cells) + f"  {ratios}")


if __name__ == "__main__":
    main()
