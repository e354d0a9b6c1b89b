r"""A mixture-of-experts model's decode throughput: splitserve's fused experts against the
same engine with a loop over every expert, and against transformers, in one run.

The model: a random Qwen3-MoE of realistic expert shape (hidden 1024, 64 experts, top 8,
expert intermediate 256, 8 layers, 16 heads of 64, 4 KV heads, vocab 32000), made once in
the splitserve cache. For C streams, C prompts of 32 tokens each generate --max-tokens
tokens greedily, EOS ignored; output tok/s is all generated tokens over the wall time
(prefill included, the same for every engine).

* `fused`: the engine as it runs (moe_experts.py's C++ kernel on CPU);
* `loop`: the same engine with the experts computed by a Python loop over all 64 experts
  (each takes the tokens routed to it), as a plain port of transformers' block does;
* `transformers`: the model in transformers, `generate` on a batch of C;
* with `--quantizations int8 fp8`, also the engine with each `--quantization` (every
  linear layer and every expert quantized per channel at load, models/quantization/).

    python -m benchmarks.moe_model_bench [--streams 1 16 64] [--max-tokens 64] [--dtype float32]
                                         [--quantizations int8 fp8] [--no-transformers]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2048,
    moe_intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    max_position_embeddings=4096,
)


def checkpoint() -> Path:
    """The random model, saved once (bf16 safetensors) with a tokenizer."""
    from models.default import cache_dir

    path = cache_dir() / "random-qwen3-moe-1024x64e"
    if not (path / "config.json").exists():
        import transformers

        from tests.models.tiny import make_tiny_tokenizer

        config = transformers.Qwen3MoeConfig(**SHAPE)
        config.architectures = ["Qwen3MoeForCausalLM"]
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(str(path))
        make_tiny_tokenizer(path)
    return path


def loop_over_experts(x, w13, w2, topk_weights, topk_ids, kernels=None):
    """Every expert in turn takes the tokens routed to it (the baseline)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    inter = w13.shape[1] // 2
    for expert in range(w13.shape[0]):
        tokens, slots = (topk_ids == expert).nonzero(as_tuple=True)
        if len(tokens) == 0:
            continue
        gate_up = F.linear(x[tokens], w13[expert]).float()
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(h.to(x.dtype), w2[expert]).float()
        out.index_add_(0, tokens, y * topk_weights[tokens, slots, None])
    return out.to(x.dtype)


def prompts(streams: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(streams)
    return torch.randint(0, 256, (streams, 32), generator=g).tolist()


def run_engine(
    path: Path, streams: int, args, loop: bool, quantization: str | None = None
) -> float:
    from models.layers import fused_moe
    from splitserve import LLM, SamplingParams

    original = fused_moe.fused_experts
    fused_moe.fused_experts = loop_over_experts if loop else original
    try:
        llm = LLM(str(path), dtype=args.dtype, max_num_seqs=max(args.streams),
                  max_model_len=512, kv_cache_memory=1 << 30,
                  quantization=quantization)  # fmt: skip
        sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate(prompts(2), SamplingParams(max_tokens=4), use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(prompts(streams), sp, use_tqdm=False)
        seconds = time.perf_counter() - start
        llm.shutdown()
    finally:
        fused_moe.fused_experts = original
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def run_transformers(path: Path, streams: int, args) -> float:
    import transformers

    dtype = getattr(torch, args.dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    ids = torch.tensor(prompts(streams))
    with torch.no_grad():
        model.generate(ids[:2], max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.max_tokens,
            min_new_tokens=args.max_tokens,
            do_sample=False,
        )
    return streams * args.max_tokens / (time.perf_counter() - start)


def main() -> None:
    os.environ.setdefault("SPLITSERVE_KV_FAULT_IN", "start")  # engines compared
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--quantizations", nargs="*", default=[], help="e.g. int8 fp8")
    args = parser.parse_args()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print(next((line for line in cpu.splitlines() if "Model name" in line), "CPU ?"))
    path = checkpoint()
    columns = ["streams", "fused tok/s", "loop over experts", "transformers"]
    print("| " + " | ".join(columns + ["fused / loop", "fused / transformers"]) + " |")
    print("|---|---|---|---|---|---|")
    for streams in args.streams:
        fused = run_engine(path, streams, args, loop=False)
        loop = run_engine(path, streams, args, loop=True)
        hf = float("nan") if args.no_transformers else run_transformers(path, streams, args)
        line = f"| {streams} | {fused:.1f} | {loop:.1f} | {hf:.1f} | {fused / loop:.2f}x | "
        line += f"{fused / hf:.2f}x |"
        for method in args.quantizations:
            rate = run_engine(path, streams, args, loop=False, quantization=method)
            line += f" {method} {rate:.1f} tok/s ({rate / fused:.2f}x fused) |"
        print(line, flush=True)


if __name__ == "__main__":
    main()
