"""Micro-benchmark of the sampler on CPU: the torch path against the C++ kernel.

    python benchmarks/sampler_bench.py [--rows 256] [--vocab 49152] [--threads 2] ...

Logits are bf16, shaped like SmolLM2's at decode (normal noise, a heavier upper tail of a
few hundred tokens and a few likely ones: max ~20 above the mean, ~60 tokens within 8 of
the max, top token ~0.75 at temperature 0.6), or a [rows, vocab] tensor saved with
torch.save (--logits). Every row of a case uses the same settings, temperature 0.6
unless the case is greedy. Prints the best time of each path over --repeat runs and
the ratio.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import KernelSet  # noqa: E402
from worker.sampler import SAMPLING_EPS, Sampler, SamplingMetadata  # noqa: E402

CASES = {
    "temperature": {},
    "top-k 50": {"top_k": 50},
    "top-p 0.9": {"top_p": 0.9},
    "min-p 0.05": {"min_p": 0.05},
    "greedy": {"temperature": 0.0},
}


def make_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * 3.0
    for count, low, spread in ((300, 4.0, 10.0), (8, 8.0, 8.0)):
        tokens = torch.randint(0, vocab, (rows, count), generator=generator)
        boost = low + spread * torch.rand(rows, count, generator=generator)
        logits.scatter_add_(1, tokens, boost)
    return logits.bfloat16()


def make_metadata(rows: int, settings: dict) -> SamplingMetadata:
    def column(name: str, dtype: torch.dtype) -> torch.Tensor | None:
        return None if name not in settings else torch.full((rows,), settings[name], dtype=dtype)

    temperature = settings.get("temperature", 0.6)
    return SamplingMetadata(
        temperature=torch.full((rows,), temperature),
        top_p=column("top_p", torch.float32),
        top_k=column("top_k", torch.int32),
        min_p=column("min_p", torch.float32),
        all_greedy=temperature < SAMPLING_EPS,
        all_random=temperature >= SAMPLING_EPS,
        generators={},
        max_num_logprobs=None,
    )


def best_time(sampler: Sampler, logits: torch.Tensor, metadata: SamplingMetadata, n: int):
    sampler(logits, metadata)  # warm up
    times = []
    for _ in range(n):
        start = time.perf_counter()
        sampler(logits, metadata)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49_152)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logits", type=Path, help="a saved [rows, vocab] logits tensor")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch_path, kernel = Sampler(kernels=KernelSet()), Sampler(kernels=KernelSet.for_device("cpu"))
    if kernel.cpu_kernel is None:
        sys.exit("the C++ sampling kernel is off or did not build (see the warning above)")
    if args.logits:
        logits = torch.load(args.logits)
    else:
        logits = make_logits(args.rows, args.vocab, args.seed)
    rows, vocab = logits.shape
    print(f"{rows} x {vocab} {logits.dtype} logits, {args.threads} threads, best of {args.repeat}")
    print(f"{'case':<12} {'torch ms':>9} {'kernel ms':>10} {'speed-up':>9}")
    for name, settings in CASES.items():
        metadata = make_metadata(rows, settings)
        slow = best_time(torch_path, logits, metadata, args.repeat)
        fast = best_time(kernel, logits, metadata, args.repeat)
        print(f"{name:<12} {slow * 1e3:9.2f} {fast * 1e3:10.2f} {slow / fast:8.1f}x")


if __name__ == "__main__":
    main()
