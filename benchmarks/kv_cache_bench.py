"""Micro-benchmark of the KV cache manager's hot path.

    python benchmarks/kv_cache_bench.py [--num-requests 1024] [--block-size 16] ...

Admits every request (get_computed_blocks + allocate_slots for the whole prompt), runs
decode steps (one token per request per step, allocate_slots of 1), then frees them all.
Workloads: unique prompts, and prompts that share long prefixes (so admissions hit the
prefix cache); also unique prompts with prefix caching off.
"""

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ipc.utils import cdiv  # noqa: E402
from kv_cache import KVCacheManager, extend_block_hashes  # noqa: E402


class BenchRequest:
    def __init__(self, request_id: str, token_ids: list[int], block_size: int) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.block_size = block_size
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []
        extend_block_hashes(self.block_hashes, token_ids, block_size)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        extend_block_hashes(self.block_hashes, self.token_ids, self.block_size)


def make_prompts(args: argparse.Namespace, shared: bool) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_len, args.max_len + 1, size=args.num_requests)
    documents = rng.integers(0, 32_000, size=(args.num_shared_prefixes, args.max_len))
    prompts = []
    for length in lengths:
        tokens = rng.integers(0, 32_000, size=length)
        if shared:  # the first 3/4 of the prompt comes from one of a few shared documents
            num_shared = length * 3 // 4
            tokens[:num_shared] = documents[rng.integers(len(documents)), :num_shared]
        prompts.append(tokens.tolist())
    return prompts


class Timer:
    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0

    def us_per_call(self) -> float:
        return self.ns / max(self.calls, 1) / 1e3


def run(args: argparse.Namespace, shared: bool, enable_caching: bool) -> dict[str, float]:
    bs = args.block_size
    prompts = make_prompts(args, shared)
    max_model_len = args.max_len + args.decode_steps
    num_blocks = sum(cdiv(len(p) + args.decode_steps, bs) for p in prompts) + 1
    manager = KVCacheManager(num_blocks, bs, max_model_len, enable_caching=enable_caching)
    timers = {name: Timer() for name in ("hash", "lookup", "admit", "decode", "free")}
    clock = time.perf_counter_ns

    def timed(name: str, fn, *fn_args):
        start = clock()
        result = fn(*fn_args)
        timers[name].ns += clock() - start
        timers[name].calls += 1
        return result

    requests = [
        timed("hash", BenchRequest, f"r{i}", prompt, bs) for i, prompt in enumerate(prompts)
    ]
    # Like an engine after start-up: the long-lived blocks are not rescanned by every GC pass.
    gc.collect()
    gc.freeze()
    num_hit_tokens_total = 0
    for request in requests:
        hits, num_hit_tokens = timed("lookup", manager.get_computed_blocks, request)
        num_hit_tokens_total += num_hit_tokens
        new_blocks = timed(
            "admit",
            manager.allocate_slots,
            request,
            request.num_tokens - num_hit_tokens,
            num_hit_tokens,
            hits,
        )
        assert new_blocks is not None
        request.num_computed_tokens = request.num_tokens
    for step in range(args.decode_steps):
        for request in requests:
            request.append_token(step)
            assert timed("decode", manager.allocate_slots, request, 1) is not None
            request.num_computed_tokens += 1
    for request in requests:
        timed("free", manager.free, request)
    gc.unfreeze()
    assert manager.block_pool.get_num_free_blocks() == num_blocks - 1
    result = {name: timer.us_per_call() for name, timer in timers.items()}
    result["hit_rate"] = num_hit_tokens_total / sum(len(p) for p in prompts)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--num-shared-prefixes", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="report the best of N runs")
    args = parser.parse_args()
    print(
        f"{args.num_requests} requests, prompts {args.min_len}-{args.max_len} tokens, "
        f"block_size {args.block_size}, {args.decode_steps} decode steps; "
        f"µs per call, best of {args.repeat}"
    )
    header = ("workload", "hash", "lookup", "admit", "decode", "free", "prefix hit rate")
    print("{:<28}{:>9}{:>9}{:>9}{:>9}{:>9}{:>17}".format(*header))
    workloads = [
        ("unique prompts", False, True),
        ("shared prefixes", True, True),
        ("unique prompts, no caching", False, False),
    ]
    for name, shared, enable_caching in workloads:
        runs = [run(args, shared, enable_caching) for _ in range(args.repeat)]
        r = {key: min(result[key] for result in runs) for key in runs[0]}
        print(
            f"{name:<28}{r['hash']:>9.1f}{r['lookup']:>9.1f}{r['admit']:>9.1f}"
            f"{r['decode']:>9.2f}{r['free']:>9.1f}{r['hit_rate']:>17.1%}"
        )
    print(
        "hash: hashing a prompt's full blocks; lookup: get_computed_blocks; admit: "
        "allocate_slots for the prompt; decode: allocate_slots of 1 token; free: free()."
    )


if __name__ == "__main__":
    main()
