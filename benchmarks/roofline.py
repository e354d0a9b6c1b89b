"""What fraction of the machine's bf16 matmul speed a throughput run reached.

The workload is the one ../shared/peers/splitserve_bench.py and vllm_cpu_bench.py run (N
requests, prompts of 100-512 random ids, outputs of 100-256 tokens, the same seeds). Its
FLOPs: 2 x the weights each token passes through (every linear layer and the LM head),
plus attention's 4 x head_dim x heads per layer for each (query, visible key) pair. The
peak is the best bf16 matmul rate measured now, on the model's own layer shapes at a
prefill-sized batch, so compare a run with a peak taken in the same hour.

    python -m benchmarks.roofline --throughput 500 [--num-seqs 256] [--model M] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from random import randint, seed

import torch
from transformers import AutoConfig

from models.default import default_model_path


def workload(num_seqs: int) -> tuple[list[int], list[int]]:
    """Prompt and output lengths, drawn exactly as the peer benchmarks draw them."""
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, 512))] for _ in range(num_seqs)]
    outputs = [randint(100, 256) for _ in range(num_seqs)]
    return [len(p) for p in prompts], outputs


def workload_flops(config, prompt_lens: list[int], output_lens: list[int]) -> float:
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = config.num_key_value_heads * head_dim
    per_layer = hidden * (heads * head_dim + 2 * kv) + heads * head_dim * hidden
    per_layer += 3 * hidden * config.intermediate_size
    weights = layers * per_layer + hidden * config.vocab_size
    tokens = sum(prompt_lens) + sum(output_lens)
    # (query, key) pairs: a prompt of L attends L(L+1)/2; output token j sees L + j keys.
    lens = zip(prompt_lens, output_lens, strict=True)
    pairs = sum(p * (p + 1) // 2 + o * p + o * (o - 1) // 2 for p, o in lens)
    return 2.0 * weights * tokens + 4.0 * layers * heads * head_dim * pairs


def matmul_peak(config, tokens: int = 2048, repeats: int = 10) -> float:
    """Best GFLOP/s of bf16 matmuls on the model's MLP and attention projection shapes."""
    hidden, inter = config.hidden_size, config.intermediate_size
    best = 0.0
    for k, n in ((hidden, 2 * inter), (inter, hidden), (hidden, 3 * hidden)):
        a = torch.randn(tokens, k).bfloat16()
        b = torch.randn(n, k).bfloat16()
        for _ in range(repeats):
            start = time.perf_counter()
            torch.nn.functional.linear(a, b)
            best = max(best, 2 * tokens * k * n / (time.perf_counter() - start) / 1e9)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--throughput", type=float, required=True, help="output tok/s of the run")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    config = AutoConfig.from_pretrained(args.model or default_model_path())
    prompt_lens, output_lens = workload(args.num_seqs)
    flops = workload_flops(config, prompt_lens, output_lens)
    wall = sum(output_lens) / args.throughput
    peak = matmul_peak(config)
    achieved = flops / wall / 1e9
    print(
        f"workload {flops / 1e12:.2f} TFLOP in {wall:.1f} s = {achieved:.0f} GFLOP/s; "
        f"bf16 matmul peak now {peak:.0f} GFLOP/s; roofline fraction {achieved / peak:.1%}"
    )


if __name__ == "__main__":
    main()
