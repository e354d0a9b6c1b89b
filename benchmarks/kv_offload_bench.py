"""The KV host tier (--kv-offload-memory) against none, in one run, in-process `LLM`.

    python -m benchmarks.kv_offload_bench [--model M] [--dtype D] [--device-blocks N]

1. Preemption pressure: --num-requests requests (prompts 200-400 random ids, 64-128
   output tokens, ignore_eos, temperature 0.6) on a device cache of --device-blocks blocks,
   so requests are preempted; output throughput with preemption by recompute and by swap
   (host tier large enough for every request).
2. Shared prefixes larger than the device cache: --num-docs prefixes of --doc-len tokens
   are read once, then each again with a new 8-token suffix (max_tokens 1, one request at
   a time). Reports the mean latency of the second round (its TTFT) and the prompt tokens
   served from the prefix cache, with the host tier off and on.
On a CPU device the host tier is the same memory: the figures show the scheduling and
copy costs, not a GPU's transfer over PCIe.
"""

from __future__ import annotations

import argparse
import os
import random
import time

from ipc.config import DTYPES
from ipc.sampling_params import SamplingParams


def _llm(args: argparse.Namespace, host_bytes: int, **kw):
    from splitserve import LLM

    return LLM(
        args.model,
        dtype=args.dtype,
        block_size=16,
        max_model_len=1024,
        num_gpu_blocks_override=args.device_blocks,
        kv_offload_memory=host_bytes,
        **kw,
    )


def preemption(args: argparse.Namespace, host_bytes: int, mode: str) -> tuple[float, object]:
    rng = random.Random(0)
    prompts = [[rng.randrange(10_000) for _ in range(rng.randint(200, 400))] for _ in range(64)]
    prompts = prompts[: args.num_requests]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(64, 128))
        for _ in prompts
    ]
    llm = _llm(args, host_bytes if mode == "swap" else 0, preemption_mode=mode)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = llm.engine.get_stats()
    llm.shutdown()
    return sum(p.max_tokens for p in params) / elapsed, stats


def shared_prefixes(args: argparse.Namespace, host_bytes: int) -> tuple[float, int]:
    rng = random.Random(1)
    docs = [[rng.randrange(10_000) for _ in range(args.doc_len)] for _ in range(args.num_docs)]
    llm = _llm(args, host_bytes)
    one = SamplingParams(temperature=0, max_tokens=1)
    for doc in docs:
        llm.generate([doc + [1] * 8], one, use_tqdm=False)
    latencies, hits = [], 0
    for doc in docs:
        start = time.perf_counter()
        out = llm.generate([doc + [2] * 8], one, use_tqdm=False)[0]
        latencies.append(time.perf_counter() - start)
        hits += out.num_cached_tokens
    llm.shutdown()
    return sum(latencies) / len(latencies), hits


def main() -> None:
    os.environ.setdefault("SPLITSERVE_KV_FAULT_IN", "start")  # engines compared
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default model if unset)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--device-blocks", type=int, default=256, help="device KV blocks")
    parser.add_argument("--host-memory", default="4GiB", help="host tier size when on")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--num-docs", type=int, default=12)
    parser.add_argument("--doc-len", type=int, default=512)
    args = parser.parse_args()
    from ipc.config import parse_bytes
    from models.default import default_model_path

    args.model = args.model or default_model_path()
    host_bytes = parse_bytes(args.host_memory)
    print(f"device cache {args.device_blocks} blocks of 16 tokens; host tier {args.host_memory}")
    for mode in ("recompute", "swap"):
        tok_s, s = preemption(args, host_bytes, mode)
        print(
            f"[preemption {mode:9}] {tok_s:8.1f} output tok/s  preemptions {s.num_preemptions}"
            f"  swapped out/in {s.num_swapped_out_blocks}/{s.num_swapped_in_blocks} blocks"
        )
    for label, size in (("off", 0), ("on", host_bytes)):
        latency, hits = shared_prefixes(args, size)
        print(
            f"[shared prefixes, host tier {label:3}] second-round TTFT {1000 * latency:8.1f} ms"
            f"  prefix-cache hit tokens {hits}"
        )


if __name__ == "__main__":
    main()
