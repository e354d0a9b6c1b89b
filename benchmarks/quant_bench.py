r"""Decode speed of the default model by weight format and KV cache dtype, offline (`LLM`).

Formats: bf16 (the converted folder), Q8_0 (the wheel's Q4_1 file requantized, see
benchmarks/gguf_requantize.py), Q4_1 (the wheel's file), int8 and fp8 online (the bf16
folder with --quantization int8|fp8); each with --kv-cache-dtype auto and fp8. A config the
engine refuses (its flag or file type not built yet) is reported as unsupported.

For B concurrent streams (prompts of --prompt-len random token ids, --output-len tokens
each, greedy, EOS ignored), decode tok/s = B * (N - 1) / (t_N - t_1), where t_N is the time
`generate` takes for N tokens per stream and t_1 for one: the time after every stream has
its first token. The whole run goes once first as a warm-up (the first pass over each
context length is several times slower), and both timings prefill the same way.

Bytes read per decoded token, by format: the weights a step reads (every linear layer and
the tied LM head; GGUF: the file's tensors as stored; int8/fp8: 1 byte a weight plus an fp32
scale per output channel, the LM head in bf16) shared by the B tokens of a step, plus each
stream's KV cache at the mean context of the run (prompt + N / 2 tokens), 2 or 1 byte a value.

    python -m benchmarks.quant_bench [--streams 1 8 64] [--formats bf16 Q4_1] [--kv auto fp8]
        [--dtype bfloat16|float32|auto]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from ipc.sampling_params import SamplingParams

FORMATS = ("bf16", "Q8_0", "Q4_1", "int8", "fp8")
KV_BYTES = {"auto": 2, "fp8": 1}


def engine_kwargs(fmt: str, folder: str) -> dict:
    from benchmarks.gguf_requantize import requantized_default
    from models.default import find_gguf

    gguf = {"Q8_0": requantized_default, "Q4_1": find_gguf}
    if fmt in gguf:
        return {"model": str(gguf[fmt]()), "tokenizer": folder}
    return {"model": folder} | ({"quantization": fmt} if fmt in ("int8", "fp8") else {})


def weight_bytes(fmt: str, folder: str) -> int:
    """Bytes of weights one decode step reads in this format."""
    if fmt in ("Q8_0", "Q4_1"):
        from gguf import GGUFReader

        return sum(int(t.n_bytes) for t in GGUFReader(engine_kwargs(fmt, folder)["model"]).tensors)
    c = json.loads((Path(folder) / "config.json").read_text())
    hidden, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    outs = (q, kv, kv, hidden, inter, inter, hidden)  # q k v o gate up down
    ins = (hidden, hidden, hidden, q, hidden, hidden, inter)
    linear = layers * sum(i * o for i, o in zip(ins, outs, strict=True))
    head = c["vocab_size"] * hidden
    norms = (2 * layers + 1) * hidden
    if fmt == "bf16":
        return 2 * (linear + head + norms)
    return linear + 4 * layers * sum(outs) + 2 * (head + norms)


def kv_bytes_per_token(folder: str, kv: str) -> int:
    c = json.loads((Path(folder) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * KV_BYTES[kv]


def decode_rate(llm, streams: int, args: argparse.Namespace) -> tuple[float, list[int]]:
    """Decode tok/s over `streams` concurrent requests, and the first stream's tokens."""
    rng = random.Random(streams)
    prompts = [[rng.randrange(10_000) for _ in range(args.prompt_len)] for _ in range(streams)]

    def run(max_tokens: int) -> tuple[float, list[int]]:
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, list(outs[0].outputs[0].token_ids)

    run(args.output_len)  # warm-up: the first pass over each context length is slow
    one, _ = run(1)
    full, tokens = run(args.output_len)
    return streams * (args.output_len - 1) / (full - one), tokens


def bench(fmt: str, kv: str, folder: str, args: argparse.Namespace) -> dict:
    from splitserve import LLM

    kwargs = engine_kwargs(fmt, folder) | ({"kv_cache_dtype": kv} if kv != "auto" else {})
    try:
        llm = LLM(dtype=args.dtype, max_model_len=args.prompt_len + args.output_len, **kwargs)
    except Exception as e:  # a flag, file type or combination not built yet
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"}
    try:
        rates = {s: decode_rate(llm, s, args) for s in args.streams}
    finally:
        llm.shutdown()
    return {"tok/s": {s: r for s, (r, _) in rates.items()}, "tokens": rates[args.streams[0]][1]}


def common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def table(results: dict, folder: str, args: argparse.Namespace) -> str:
    streams = args.streams
    ctx = args.prompt_len + args.output_len // 2
    heads = [f"decode tok/s @{s}" for s in streams] + [
        f"MB read/token @{s}" for s in streams
    ] + ["greedy = bf16"]  # fmt: skip
    lines = ["| weights | KV | " + " | ".join(heads) + " |", "|---" * (len(heads) + 2) + "|"]
    reference = results.get(("bf16", "auto"), {}).get("tokens")
    for (fmt, kv), r in results.items():
        if "error" in r:
            lines.append(f"| {fmt} | {kv} | unsupported: {r['error']} |")
            continue
        weights, per_token = weight_bytes(fmt, folder), kv_bytes_per_token(folder, kv) * ctx
        rates = [f"{r['tok/s'][s]:.1f}" for s in streams]
        traffic = [f"{(weights / s + per_token) / 1e6:.1f}" for s in streams]
        same = f"{common_prefix(reference, r['tokens'])}/{len(reference)}" if reference else "-"
        lines.append(f"| {fmt} | {kv} | " + " | ".join(rates + traffic + [same]) + " |")
    return "\n".join(lines)


def main() -> None:
    os.environ.setdefault("SPLITSERVE_KV_FAULT_IN", "start")  # engines compared
    from benchmarks.compare_llamacpp import cpu_name
    from models.default import default_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--kv", nargs="+", default=list(KV_BYTES), choices=list(KV_BYTES))
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32", "auto"),
        help="activations; auto: each model's default (a GGUF file runs in float32 on a "
        "CPU without bf16 instructions, the bf16 folder in bf16)",
    )
    args = p.parse_args()
    folder = default_model_path()
    results = {}
    for fmt in args.formats:
        for kv in args.kv:
            r = results[fmt, kv] = bench(fmt, kv, folder, args)
            print(f"[{fmt} / kv {kv}] {r.get('tok/s', r.get('error'))}", flush=True)
    print(
        f"\nSmolLM2-135M-Instruct, {cpu_name()}, dtype {args.dtype}; prompts of "
        f"{args.prompt_len} tokens, "
        f"{args.output_len} output tokens; Q8_0 is the Q4_1 file requantized\n"
    )
    print(table(results, folder, args))


if __name__ == "__main__":
    main()
