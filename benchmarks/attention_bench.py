r"""One decode step's attention for one layer: the torch backend (page gather + SDPA)
against the C++ kernel (cpu backend), in the same process, on SmolLM2's shape by default
(9 query heads, 3 KV heads, head_dim 64, bf16, block 16), contexts uniform in [lo, hi].
With --query-len 2..8, each request's row has that many query tokens, as a speculative
step's verification: the torch backend attends to each as a prefill (one SDPA per
request), the cpu backend as one decode per token in its kernel call.
With --triton, on a GPU: the Triton backend's decode launch split over the context
(flash-decoding, as its heuristic picks) against the unsplit launch. With --sweep: the
decode launch over key tile widths, num_warps and num_stages, against the default.

    python -m benchmarks.attention_bench [--decodes 256] [--context 100 512] [--threads 2]
    python -m benchmarks.attention_bench --decodes 64 --context 200 612 --layers 30 --dtype float32
    python -m benchmarks.attention_bench --decodes 16 --query-len 5 --context 512 512
    python -m benchmarks.attention_bench --triton --decodes 4 --context 4096 32768
    python -m benchmarks.attention_bench --sweep --decodes 256 --context 100 2048 \
        --heads 16 --kv-heads 8 --head-dim 128      # Qwen3-0.6B, nano-vllm's decode mix
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time

import torch

from attention import Attention, CommonAttentionMetadata, set_forward_context
from attention.backends.cpu_backend import CPUAttentionBackend, load_cpu_attention
from attention.backends.torch_backend import TorchAttentionBackend
from attention.backends.triton_backend import (
    TARGET_DECODE_PROGRAMS,
    DecodeLaunch,
    TritonAttentionBackend,
    decode_num_splits,
)
from ipc.utils import cdiv
from kernels import KernelSet
from kernels.huge_pages import zeros_on_huge_pages


def decode_batch(
    args: argparse.Namespace,
) -> tuple[CommonAttentionMetadata, torch.Tensor, Attention]:
    gen = torch.Generator().manual_seed(0)
    n, bs, query_len = args.decodes, args.block_size, args.query_len
    seq_lens = torch.randint(args.context[0], args.context[1] + 1, (n,), generator=gen)
    if args.longest_first:
        seq_lens = seq_lens.sort(descending=True).values
    max_blocks = cdiv(int(seq_lens.max()), bs)
    num_blocks = n * max_blocks + 1
    table = (torch.randperm(num_blocks - 1, generator=gen)[: n * max_blocks] + 1).view(
        n, max_blocks
    )
    dtype = getattr(torch, args.dtype)
    shape = (2, num_blocks, bs, args.kv_heads, args.head_dim)
    caches = [zeros_on_huge_pages(shape, dtype) for _ in range(args.layers)]  # as the worker
    for cache in caches:
        cache.copy_(torch.randn(shape, generator=gen))
    cache = caches[0]
    starts = torch.arange(n + 1, dtype=torch.int32) * query_len
    positions = seq_lens[:, None] - query_len + torch.arange(query_len)  # each row's tokens
    slots = (table.gather(1, positions // bs) * bs + positions % bs).flatten()
    common = CommonAttentionMetadata(
        num_actual_tokens=n * query_len,
        max_query_len=query_len,
        max_seq_len=int(seq_lens.max()),
        query_start_loc=starts,
        seq_lens=seq_lens.to(torch.int32),
        block_table=table.to(torch.int32),
        slot_mapping=slots,
        query_start_loc_cpu=starts.clone(),
        seq_lens_cpu=seq_lens.to(torch.int32),
    )
    layer = Attention(args.heads, args.head_dim, args.head_dim**-0.5, args.kv_heads)
    layer.kv_cache = cache
    layer.caches = caches
    return common, cache, layer


def time_backend(backend, common, layer, args) -> float:
    device = layer.kv_cache.device
    num_tokens = args.decodes * args.query_len
    q = torch.randn(num_tokens, (args.heads + 2 * args.kv_heads) * args.head_dim)
    q, k, v = q.to(device, layer.kv_cache.dtype).split(
        [args.heads * args.head_dim, args.kv_heads * args.head_dim, args.kv_heads * args.head_dim],
        1,
    )
    best = float("inf")
    caches = getattr(layer, "caches", [layer.kv_cache])
    for _ in range(args.repeats):
        md = backend.build_metadata(common)
        with set_forward_context([md], backend):
            start = time.perf_counter()
            for cache in caches:  # one layer after another, as a step reads them
                layer.kv_cache = cache
                layer(q, k, v)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, (time.perf_counter() - start) / len(caches))
    return best


def triton_on_device(common, layer):
    """The batch's device tensors and the cache on the GPU (without one, under
    TRITON_INTERPRET=1, on the CPU: a smoke test only)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_device = {
        f.name: getattr(common, f.name).to(device)
        for f in dataclasses.fields(common)
        if f.name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
    }
    layer.caches = [c.to(device) for c in layer.caches]
    layer.kv_cache = layer.caches[0]
    return dataclasses.replace(common, **on_device)


def time_triton(common, layer, args, read: float, label: str, backend) -> float:
    time_backend(backend, common, layer, args)  # compiles the kernels
    seconds = time_backend(backend, common, layer, args)
    rate = read / seconds / 1e9
    print(f"{label:>40}: {seconds * 1e3:7.3f} ms per layer, K/V read {rate:6.1f} GB/s")
    return seconds


def compare_triton_splits(common, layer, args, read: float) -> None:
    """The Triton backend with its context split against without."""
    backend = TritonAttentionBackend()
    max_context = common.block_table.shape[1] * args.block_size
    num_splits = decode_num_splits(args.decodes, args.kv_heads, max_context, backend.decode.block_n)
    split = time_triton(common, layer, args, read, f"{num_splits} splits", backend)
    unsplit = TritonAttentionBackend(target_decode_programs=1)
    unsplit = time_triton(common, layer, args, read, "unsplit", unsplit)
    print(f"split / unsplit speed-up: {unsplit / split:.2f}x")


def sweep_triton_decode(common, layer, args, read: float) -> None:
    """The decode launch over key tile widths, warps, pipeline stages and split targets
    (the splits the heuristic picks for each width and target), then the fastest against
    the default."""
    default = time_triton(common, layer, args, read, "default", TritonAttentionBackend())
    max_context = common.block_table.shape[1] * args.block_size
    results = {}
    for block_n, num_warps, num_stages, target in itertools.product(
        args.sweep_block_n, args.sweep_warps, args.sweep_stages, args.sweep_targets
    ):
        launch = DecodeLaunch(block_n, num_warps, num_stages)
        splits = decode_num_splits(args.decodes, args.kv_heads, max_context, block_n, target)
        label = f"block_n {block_n} warps {num_warps} stages {num_stages} splits {splits}"
        backend = TritonAttentionBackend(target_decode_programs=target, decode=launch)
        results[label] = time_triton(common, layer, args, read, label, backend)
    best = min(results, key=results.get)
    print(f"fastest: {best}, {default / results[best]:.2f}x the default")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decodes", type=int, default=256)
    p.add_argument("--context", type=int, nargs=2, default=(100, 512))
    p.add_argument("--query-len", type=int, default=1, help="query tokens per request")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument(
        "--layers",
        type=int,
        default=1,
        help="caches read in turn (30: SmolLM2's, so the pages come from memory as in a step)",
    )
    p.add_argument("--triton", action="store_true", help="the Triton split KV vs unsplit")
    p.add_argument("--sweep", action="store_true", help="the Triton decode launch's options")
    p.add_argument(
        "--longest-first",
        action="store_true",
        help="requests in descending context order (default: random), so the longest "
        "programs are dispatched first",
    )
    p.add_argument("--sweep-block-n", type=int, nargs="+", default=(16, 32, 64, 128))
    p.add_argument("--sweep-warps", type=int, nargs="+", default=(2, 4, 8))
    p.add_argument("--sweep-stages", type=int, nargs="+", default=(1, 2, 3, 4))
    p.add_argument(
        "--sweep-targets",
        type=int,
        nargs="+",
        default=(TARGET_DECODE_PROGRAMS,),
        help="programs a decode launch splits to fill (the heuristic's target)",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    common, cache, layer = decode_batch(args)
    read = (
        float(common.seq_lens_cpu.sum()) * 2 * args.kv_heads * args.head_dim * cache.element_size()
    )
    if args.triton or args.sweep:
        common = triton_on_device(common, layer)
        (sweep_triton_decode if args.sweep else compare_triton_splits)(common, layer, args, read)
        return
    kernels = load_cpu_attention(KernelSet.for_device("cpu"))
    if kernels is None:
        raise SystemExit(
            "the C++ attention kernels are off (SPLITSERVE_CPU_KERNELS) or did not build"
        )
    results = {}
    for backend in (TorchAttentionBackend(), CPUAttentionBackend(kernels)):
        seconds = time_backend(backend, common, layer, args)
        results[backend.name] = seconds
        rate = read / seconds / 1e9
        print(f"{backend.name:>6}: {seconds * 1e3:7.2f} ms per layer, K/V read {rate:5.1f} GB/s")
    print(f"cpu / torch speed-up: {results['torch'] / results['cpu']:.2f}x")


if __name__ == "__main__":
    main()
