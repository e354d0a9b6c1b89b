r"""Speculative decoding (ngram, a draft model) against plain decoding, offline, in one run.

Three chat workloads on the default model (as launch.py serves it on this machine, or
--weights gguf: its Q4_1 file; greedy, EOS respected, at most --max-tokens
tokens each): `repeat` asks to write a paragraph out again with its typos fixed (the
answer copies the prompt), `code` to complete a Python class whose methods repeat its
fields, `chat` asks open questions. For concurrency C, max(8, --requests-per-stream x C)
requests run in a closed loop on the EngineCore: C in flight, the next added as one
finishes (as a serving benchmark's max concurrency). Output tok/s is the tokens generated
over the wall time; greedy speculation is exact, so both engines generate the same tokens
(the script counts requests whose tokens differ: a near tie can flip where a
verification row and a single-token step round differently). --rounds R runs each cell
R times (every other round with the engines in reverse order) and sums them.

Every engine (1 GiB of KV cache each) starts once and warms up on a short wave, and each
cell runs on every engine back to back (the CPU's speed drifts over minutes); `plain` runs
without a speculative
config, `ngram-kK` with {"method": "ngram", "num_speculative_tokens": K,
"prompt_lookup_min": 2, "prompt_lookup_max": 4} and the gate at its defaults (--no-gate
sets adaptive false: every step speculates). `draftL-kK` (--draft-layers L) drafts with
the default model's layers L: the first N for "N", those listed for "0-3,26-29"
(benchmarks/gguf_requantize.py --layers L: same file type, same tokenizer),
{"method": "draft_model", "num_speculative_tokens": K}. The acceptance rate and mean
acceptance length are those of each cell.

    python -m benchmarks.spec_decode_bench [--k 2 4 6] [--concurrency 1 4 16 64]
        [--workloads repeat code chat] [--max-tokens 128] [--draft-layers 4 0-3,26-29]
        [--no-ngram] [--weights default|gguf] [--rounds 1]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import time
from collections import deque

from benchmarks.gguf_requantize import truncated_default
from ipc.sampling_params import SamplingParams

WORDS = {
    name: words.split()
    for name, words in {
        "adj": "quiet bright old narrow busy cold green tall hidden heavy",
        "noun": "river market bridge garden library harbor station village tower orchard",
        "verb": "opens closes shelters crosses feeds guards lights faces joins borders",
        "city": "Lyon Porto Graz Turku Ghent Bergen Split Brno Cork Malmo",
        "day": "Monday Tuesday Friday Sunday morning evening",
        "field": "name price count owner color weight width height label status",
        "cls": "Order Ticket Parcel Invoice Sensor Booking Account Shipment",
    }.items()
}
CHAT = [
    "What should I pack for a week of hiking in the mountains?",
    "Explain how a bicycle gear system works.",
    "Give me three ideas for a birthday party for a ten year old.",
    "Why is the sky blue?",
    "How do I start learning to play the guitar?",
    "What are the benefits of drinking water every day?",
    "Write a short poem about the sea.",
    "How does a refrigerator keep food cold?",
    "What is the difference between weather and climate?",
    "Suggest a simple recipe for dinner tonight.",
    "How can I improve my sleep?",
    "Tell me about the history of the printing press.",
    "What makes a good team leader?",
    "How do plants make their food?",
    "Describe a day in the life of a lighthouse keeper.",
    "What are some tips for saving money on groceries?",
]


def _typo(word: str, rng: random.Random) -> str:
    if len(word) < 4 or rng.random() > 0.3:
        return word
    i = rng.randrange(1, len(word) - 2)
    return word[:i] + word[i + 1] + word[i] + word[i + 2 :]


def repeat_prompt(i: int) -> str:
    rng = random.Random(i)
    sentences = []
    for _ in range(5):
        w = {k: rng.choice(v) for k, v in WORDS.items()}
        sentences.append(
            f"The {w['adj']} {w['noun']} in {w['city']} {w['verb']} the old {w['noun']} "
            f"every {w['day']}."
        )
    text = " ".join(_typo(word, rng) for word in " ".join(sentences).split())
    return f"Write this paragraph out again with the spelling mistakes fixed:\n\n{text}"


def code_prompt(i: int) -> str:
    rng = random.Random(100 + i)
    name = rng.choice(WORDS["cls"])
    fields = rng.sample(WORDS["field"], 4)
    args = ", ".join(fields)
    body = "\n".join(f"        self.{f} = {f}" for f in fields)
    return (
        "Complete this Python class: add to_dict, from_dict and __repr__ methods.\n\n"
        f"```python\nclass {name}:\n    def __init__(self, {args}):\n{body}\n"
    )


PROMPTS = {"repeat": repeat_prompt, "code": code_prompt, "chat": lambda i: CHAT[i % len(CHAT)]}


def run_cell(llm, workload: str, concurrency: int, args) -> dict:
    """Closed loop: `concurrency` requests in flight, the next one added as one finishes,
    until --requests-per-stream x concurrency (at least 8) have run."""
    n = max(8, args.requests_per_stream * concurrency)
    processor, engine = llm.input_processor, llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    pending = deque()
    for i in range(n):
        ids = processor.chat_token_ids([{"role": "user", "content": PROMPTS[workload](i)}])
        pending.append(processor.process(ids, params, f"{workload}-{concurrency}-{i}")[0])
    before = engine.get_stats()
    tokens: dict[str, list[int]] = {}
    in_flight: set[str] = set()
    start = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            request = pending.popleft()
            engine.add_request(request)
            in_flight.add(request.request_id)
            tokens[request.request_id] = []
        for out in engine.step().outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                in_flight.discard(out.request_id)
    seconds = time.perf_counter() - start
    after = engine.get_stats()
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    draft_tokens = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    num_tokens = sum(map(len, tokens.values()))
    return {"seconds": seconds, "num_tokens": num_tokens, "tokens": list(tokens.values()),
            "drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted}  # fmt: skip


def add_round(total: dict | None, cell: dict) -> dict:
    """A cell's rounds summed; the tokens are the first round's (greedy: every round's)."""
    if total is None:
        return cell
    counts = ("seconds", "num_tokens", "drafts", "draft_tokens", "accepted")
    return {**total, **{key: total[key] + cell[key] for key in counts}}


def make_llm(spec: dict | None, args):
    from models.default import default_model_path, find_gguf, serve_args
    from splitserve import LLM

    if args.weights == "gguf":
        model, tokenizer = str(find_gguf()), default_model_path()
    else:  # what launch.py serves here: the folder where bf16 is native, else the GGUF file
        flags = dict(zip(serve_args()[::2], serve_args()[1::2], strict=True))
        model, tokenizer = flags["--model"], flags.get("--tokenizer")
    llm = LLM(model, tokenizer=tokenizer, max_num_seqs=max(args.concurrency),
              speculative_config=spec, dtype=args.dtype, kv_cache_memory=1 << 30)  # fmt: skip
    llm.chat([[{"role": "user", "content": "Hello!"}]] * 2, SamplingParams(max_tokens=16))
    return llm


def main() -> None:
    os.environ.setdefault("SPLITSERVE_KV_FAULT_IN", "start")  # engines compared
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 6])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--workloads", nargs="+", default=list(PROMPTS), choices=list(PROMPTS))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="runs of each cell, summed")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--no-gate", action="store_true", help="adaptive false")
    parser.add_argument("--draft-layers", nargs="*", default=[], help="N or 0-3,26-29")
    parser.add_argument("--no-ngram", action="store_true", help="only the draft models")
    parser.add_argument(
        "--weights",
        choices=("default", "gguf"),
        default="default",
        help="the default model as launch.py serves it here, or its Q4_1 file",
    )
    args = parser.parse_args()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print(next((line for line in cpu.splitlines() if "Model name" in line), "CPU ?"))
    configs: dict[str, dict | None] = {"plain": None}
    for k in args.k:
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                "prompt_lookup_max": 4}  # fmt: skip
        if not args.no_ngram:
            configs[f"ngram-k{k}"] = spec
        for layers in args.draft_layers:
            draft = str(truncated_default(layers))
            configs[f"draft{layers}-k{k}"] = {"method": "draft_model", "model": draft,
                                         "num_speculative_tokens": k}  # fmt: skip
    for spec in configs.values():
        if spec is not None and args.no_gate:
            spec["adaptive"] = False
    results: dict[tuple[str, str, int], dict] = {}
    engines = {name: make_llm(spec, args) for name, spec in configs.items()}
    for workload in args.workloads:
        for c in args.concurrency:
            for round_ in range(args.rounds):
                # Back to back, every other round in reverse: the CPU's speed drifts.
                order = list(engines.items())[:: -1 if round_ % 2 else 1]
                for name, llm in order:
                    cell = run_cell(llm, workload, c, args)
                    results[name, workload, c] = add_round(results.get((name, workload, c)), cell)
                    rate = cell["num_tokens"] / cell["seconds"]
                    print(f"{name:16} {workload:6} c={c:<3} {rate:7.1f} tok/s", flush=True)
    for llm in engines.values():
        llm.shutdown()
    print("\n| workload | concurrency | plain tok/s | " + " | ".join(list(configs)[1:]) + " |")
    print("|---|---|---|" + "---|" * (len(configs) - 1))
    for workload in args.workloads:
        for c in args.concurrency:
            base = results["plain", workload, c]
            base_rate = base["num_tokens"] / base["seconds"]
            cells = []
            for name in list(configs)[1:]:
                cell = results[name, workload, c]
                differ = sum(a != b for a, b in zip(cell["tokens"], base["tokens"], strict=True))
                text = f"{cell['num_tokens'] / cell['seconds'] / base_rate:.2f}x"
                if cell["draft_tokens"]:
                    acceptance = 100 * cell["accepted"] / cell["draft_tokens"]
                    mean_len = 1 + cell["accepted"] / cell["drafts"]
                    text += f" (acc {acceptance:.0f}%, len {mean_len:.2f})"
                if differ:
                    text += f" [{differ} differ]"
                cells.append(text)
            print(f"| {workload} | {c} | {base_rate:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
