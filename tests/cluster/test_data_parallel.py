"""Data parallelism (`launch.py --data-parallel-size 2`): two EngineCores, each with its
own worker, behind one HTTP server. Both serve (the metrics say which engine ran what),
their answers are transformers' greedy ones, and an engine that dies is started again
alone: its streams end with an error event, the other engine's go on, and the cluster
serves throughout. With `--api-server-count 2`, two HTTP servers share the port, both
answer, and every scrape gives the sum of their metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.cluster.helpers import child_pids, start_launch, wait_ready
from tests.integration.greedy import greedy_reference

MAX_TOKENS = 8
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(256) for _ in range(n)] for n in (5, 12, 30, 7, 19, 44, 3, 26)]


@contextlib.contextmanager
def dp_cluster(tmp_path, model: str, *more: str):
    """launch.py -dp 2 with the HTTP server; yields (process, log, base url)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ("--model", model, "--dtype", "float32", "--kv-cache-memory", "64MiB", "-dp", "2")
    process, log, address_file = start_launch(
        tmp_path, *args, *more, "--api-host", "127.0.0.1", "--api-port", str(port)
    )
    try:
        addresses = wait_ready(process, log, address_file)
        assert len(addresses.split(",")) == 2
        yield process, log, f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, log.read_text()


def engine_counts(base_url: str, name: str = "request_success_total") -> dict[str, float]:
    """The metric `name` summed by its engine label."""
    counts: dict[str, float] = {}
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        match = re.match(rf"splitserve:{name}{{(.*)}} ([\d.e+]+)$", line)
        if match:
            engine = re.search(r'engine="(\d+)"', match.group(1)).group(1)
            counts[engine] = counts.get(engine, 0.0) + float(match.group(2))
    return counts


async def _complete_all(base_url: str, prompts: list[list[int]]) -> list[list[int]]:
    body = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:

        async def one(prompt):
            reply = await http.post("/v1/completions", json={**body, "prompt": prompt})
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["token_ids"]

        return await asyncio.gather(*(one(p) for p in prompts))


def test_two_engines_both_serve_greedy_answers(tmp_path, llama_path):
    greedy = greedy_reference(llama_path, ignore_eos=False)
    with dp_cluster(tmp_path, llama_path) as (process, log, base_url):
        pids = child_pids(log.read_text())
        assert {"engine core 0", "engine core 1"} <= set(pids)
        assert {"engine core 0 worker rank 0", "engine core 1 worker rank 0"} <= set(pids)
        answers = asyncio.run(_complete_all(base_url, PROMPTS))
        served = engine_counts(base_url)
        assert set(served) == {"0", "1"} and sum(served.values()) == len(PROMPTS)
        running = engine_counts(base_url, "num_requests_running")
        assert set(running) == {"0", "1"}
    assert answers == [greedy(p, MAX_TOKENS) for p in PROMPTS]


def _stream(base_url: str, events: list, failures: list) -> None:
    body = {"prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: ") :]))
    except httpx.HTTPError as e:
        failures.append(e)


@pytest.mark.slow  # 13 s on 2 Zen 4 cores
def test_a_dead_engine_is_restarted_alone(tmp_path, llama_path):
    with dp_cluster(tmp_path, llama_path) as (process, log, base_url):
        streams = [([], []) for _ in range(4)]
        threads = [threading.Thread(target=_stream, args=(base_url, *s)) for s in streams]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while sum(engine_counts(base_url, "num_requests_running").values()) < 4:
            assert time.monotonic() < deadline, "the 4 streams never all ran"
            time.sleep(0.05)
        running = engine_counts(base_url, "num_requests_running")
        assert running["0"] >= 1 and running["1"] >= 1, running
        killed = time.monotonic()
        os.kill(child_pids(log.read_text())["engine core 1"], signal.SIGKILL)
        for t in threads:
            t.join(60)
        last = [events[-1] for events, _ in streams]
        errors = [e for e in last if "error" in e]
        finished = [
            e for e in last if "choices" in e and e["choices"][0]["finish_reason"] == "length"
        ]
        assert (len(errors), len(finished)) == (running["1"], running["0"]), last
        assert all(e["error"]["type"] == "service_unavailable" for e in errors)
        assert not any(failures for _, failures in streams)
        # The cluster served throughout; engine 1 comes back with a fresh worker.
        assert process.poll() is None
        deadline = killed + 90
        while "engine core 1 ready again" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert "engine core 1 died with exit code -9; restarting it" in log.read_text()
        before = engine_counts(base_url).get("1", 0.0)
        for _ in range(20):
            asyncio.run(_complete_all(base_url, PROMPTS[:4]))
            if engine_counts(base_url).get("1", 0.0) > before:
                break
        else:
            pytest.fail("the restarted engine got no request")


def _metrics_folder(pid: int) -> Path:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    (entry,) = [e for e in environ if e.startswith(b"PROMETHEUS_MULTIPROC_DIR=")]
    return Path(entry.split(b"=", 1)[1].decode())


@pytest.mark.slow  # 12 s on 2 Zen 4 cores
def test_two_api_servers_share_the_port_and_sum_their_metrics(tmp_path, llama_path):
    with dp_cluster(tmp_path, llama_path, "--api-server-count", "2") as (process, log, base_url):
        pids = child_pids(log.read_text())
        servers = [pids["api server 0"], pids["api server 1"]]
        folder = _metrics_folder(servers[0])
        assert folder == _metrics_folder(servers[1])
        body = {"prompt": PROMPTS[0], "max_tokens": 2}
        for _ in range(24):  # a connection each: the kernel picks the server
            with httpx.Client(base_url=base_url, timeout=60) as http:
                assert http.post("/v1/completions", json=body).status_code == 200
        answered = {int(p.stem.rsplit("_", 1)[1]) for p in folder.glob("histogram_*.db")}
        assert answered == set(servers)
        for _ in range(6):  # whichever server answers the scrape counts both
            assert sum(engine_counts(base_url).values()) == 24
        os.kill(servers[0], signal.SIGKILL)
        time.sleep(0.5)
        for _ in range(6):  # the other one takes every connection meanwhile
            with httpx.Client(base_url=base_url, timeout=60) as http:
                assert http.post("/v1/completions", json=body).status_code == 200
        deadline = time.monotonic() + 60
        while "api server 0 died with exit code -9; restarting it" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    assert not folder.exists()
