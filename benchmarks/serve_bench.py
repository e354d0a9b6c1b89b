r"""Load test of the OpenAI-compatible HTTP API, with streaming requests.

Every request is a streaming /v1/completions whose prompt is a list of random token ids
and whose output length is fixed (min_tokens = max_tokens, ignore_eos). Workloads:
`random` (prompt lengths uniform in the input range) and `shared-prefix` (one of
`--num-prefixes` random prefixes of `--prefix-len` tokens, then a unique suffix with a
length in the input range). Output lengths are uniform in the output range.

Measured per request from the client: TTFT (request sent to first text chunk), ITL (time
between text chunks), TPOT ((latency - TTFT) / (output tokens - 1)). Reported per load:
request and output token throughput, and mean, median and p99 of TTFT, TPOT and ITL.

    python -m benchmarks.serve_bench --base-url http://127.0.0.1:8000 --num-requests 200 \
        --max-concurrency 16
    python -m benchmarks.serve_bench --request-rate 4 --workload shared-prefix
    python -m benchmarks.serve_bench --sweep 1,16,64 --plot serve_bench.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


def make_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(args.min_token_id, args.max_token_id) for _ in range(n)]

    prefixes = [tokens(args.prefix_len) for _ in range(args.num_prefixes)]
    prompts, output_lens = [], []
    for _ in range(args.num_requests):
        prompt = tokens(rng.randint(args.min_input_len, args.max_input_len))
        if args.workload == "shared-prefix":
            prompt = rng.choice(prefixes) + prompt
        prompts.append(prompt)
        output_lens.append(rng.randint(args.min_output_len, args.max_output_len))
    return Workload(prompts, output_lens)


async def send_request(
    client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "min_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    chunk_times = []
    result = RequestResult(ok=True)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return RequestResult(ok=False, error=f"{response.status_code}: {response.text}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(ok=False, error=chunk["error"]["message"])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    chunk_times.append(time.perf_counter())
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        return RequestResult(ok=False, error=repr(e))
    if not chunk_times:
        return RequestResult(ok=False, error="no text came back")
    result.latency = time.perf_counter() - start
    result.ttft = chunk_times[0] - start
    result.itls = list(np.diff(chunk_times))
    return result


async def run_load(
    args: argparse.Namespace, workload: Workload, model: str, concurrency: int | None
) -> dict:
    """Send the workload at `args.request_rate` (Poisson arrivals), with at most
    `concurrency` requests in flight; return the summary."""
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(concurrency or len(workload.prompts))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=_auth(args), timeout=None, limits=limits
    ) as client:

        async def limited(prompt: list[int], output_len: int) -> RequestResult:
            async with limit:
                return await send_request(client, model, prompt, output_len)

        start = time.perf_counter()
        tasks = []
        for prompt, output_len in zip(workload.prompts, workload.output_lens, strict=True):
            tasks.append(asyncio.create_task(limited(prompt, output_len)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, concurrency)


def summarize(results: list[RequestResult], duration: float, concurrency: int | None) -> dict:
    done = [r for r in results if r.ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    summary = {
        "concurrency": concurrency,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": sum(r.output_tokens for r in done) / duration,
    }
    for name, values in (
        ("ttft", [r.ttft for r in done]),
        ("tpot", tpots),
        ("itl", [itl for r in done for itl in r.itls]),
    ):
        ms = np.array(values or [math.nan]) * 1000
        summary[name] = {
            "mean": float(ms.mean()),
            "median": float(np.median(ms)),
            "p99": float(np.percentile(ms, 99)),
        }
    return summary


def report(summary: dict, request_rate: float) -> None:
    print(
        f"==== max concurrency {summary['concurrency'] or 'unlimited'}, "
        f"request rate {request_rate:g}/s ===="
    )
    print(f"completed            {summary['completed']} (failed {summary['failed']})")
    for error in summary["errors"]:
        print(f"  error: {error}")
    print(f"duration             {summary['duration_s']:.2f} s")
    print(f"request throughput   {summary['request_throughput']:.2f} req/s")
    print(f"output throughput    {summary['output_throughput']:.1f} tok/s")
    for name in ("ttft", "tpot", "itl"):
        s = summary[name]
        print(
            f"{name.upper():4} ms              mean {s['mean']:9.2f}   median {s['median']:9.2f}"
            f"   p99 {s['p99']:9.2f}"
        )


def plot(summaries: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = [s["concurrency"] for s in summaries]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, name in zip(axes[:3], ("ttft", "tpot", "itl"), strict=True):
        for stat, style in (("mean", "o-"), ("median", "s--"), ("p99", "^:")):
            ax.plot(loads, [s[name][stat] for s in summaries], style, label=stat)
        ax.set(title=f"{name.upper()} (ms)", xlabel="max concurrency", xscale="log")
        ax.legend()
    axes[3].plot(loads, [s["output_throughput"] for s in summaries], "o-")
    axes[3].set(title="output throughput (tok/s)", xlabel="max concurrency", xscale="log")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _auth(args: argparse.Namespace) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def served_model(args: argparse.Namespace) -> str:
    async with httpx.AsyncClient(base_url=args.base_url, headers=_auth(args)) as client:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]


async def main(args: argparse.Namespace) -> list[dict]:
    model = args.model or await served_model(args)
    workload = make_workload(args)
    loads = [int(c) for c in args.sweep.split(",")] if args.sweep else [args.max_concurrency]
    summaries = []
    for concurrency in loads:
        summary = await run_load(args, workload, model, concurrency)
        report(summary, args.request_rate)
        summaries.append(summary)
    if args.sweep:
        plot(summaries, args.plot)
        print(f"plot written to {args.plot}")
    return summaries


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="default: the server's first model")
    parser.add_argument("--api-key", default=os.environ.get("SPLITSERVE_API_KEY"))
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--max-concurrency", type=int, help="default: unlimited")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default: all at once)",
    )
    parser.add_argument("--sweep", help="comma-separated max concurrencies, e.g. 1,16,64")
    parser.add_argument("--plot", default="serve_bench.png", help="PNG written by --sweep")
    parser.add_argument("--workload", choices=("random", "shared-prefix"), default="random")
    parser.add_argument("--min-input-len", type=int, default=100)
    parser.add_argument("--max-input-len", type=int, default=512)
    parser.add_argument("--min-output-len", type=int, default=100)
    parser.add_argument("--max-output-len", type=int, default=256)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--num-prefixes", type=int, default=1)
    parser.add_argument("--min-token-id", type=int, default=100)
    parser.add_argument(
        "--max-token-id",
        type=int,
        default=10_000,
        help="exclusive; keep it under the model's vocabulary size",
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
