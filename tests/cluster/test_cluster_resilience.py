"""A worker that dies or hangs is replaced and its requests replayed: clients see a pause,
not an error, and greedy outputs equal transformers'; restarts are bounded; SIGTERM
drains (running requests finish, new ones are refused) before the cluster exits; an API
server that dies is started again; an engine that dies ends HTTP streams with an error
event, not a silent cut."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import threading
import time

import httpx
import pytest

from ipc.client import EngineClient, RequestError
from ipc.messages import ErrorCode
from ipc.processes import pid_alive
from ipc.sampling_params import SamplingParams
from tests.cluster.helpers import (
    TEST_ARGS,
    child_pids,
    start_launch,
    wait_idle,
    wait_ready,
)
from tests.integration.greedy import greedy_reference

MAX_TOKENS = 120
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
_rng = random.Random(1)
PROMPTS = [[_rng.randrange(256) for _ in range(n)] for n in (5, 30, 12, 47)]
_reference: list[list[int]] = []


def _expected(model: str) -> list[list[int]]:
    if not _reference:
        greedy = greedy_reference(model, ignore_eos=False)
        _reference.extend(greedy(p, MAX_TOKENS) for p in PROMPTS)
    return _reference


def _start(tmp_path, model: str, *args: str):
    process, log, address_file = start_launch(tmp_path, "--model", model, *TEST_ARGS, *args)
    return process, log, wait_ready(process, log, address_file)


def _stream_all(client: EngineClient, started: threading.Barrier) -> list[list[int]]:
    """Stream every prompt in its own thread; `started` is passed once all have a token."""
    results: list[list[int]] = [[] for _ in PROMPTS]

    def run(i: int) -> None:
        for n, delta in enumerate(client.stream(PROMPTS[i], GREEDY)):
            results[i].extend(delta.outputs[0].token_ids)
            if n == 0:
                started.wait()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def _disturbed_run(address: str, disturb) -> list[list[int]]:
    """Stream every prompt; once each has its first token, call `disturb`."""
    with EngineClient(address) as client:
        started = threading.Barrier(len(PROMPTS) + 1)
        outcome: list[list[list[int]]] = []
        runner = threading.Thread(target=lambda: outcome.append(_stream_all(client, started)))
        runner.start()
        started.wait(timeout=60)
        disturb()
        runner.join(timeout=120)
        assert outcome, "the streams did not finish"
        stats = wait_idle(client)
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_cache_usage == 0.0
    return outcome[0]


def _stop(process) -> int:
    process.send_signal(signal.SIGTERM)
    return process.wait(timeout=30)


@pytest.mark.gpus(2)
@pytest.mark.parametrize(
    ("rank", "sig", "args", "logged"),
    [
        (1, signal.SIGKILL, (), "replacing the workers (restart 1) and replaying"),
        # 13 s: slow (the killed case covers the replacement and the replay)
        pytest.param(
            0,
            signal.SIGSTOP,
            ("--worker-step-timeout", "2"),
            "did not answer step",
            marks=pytest.mark.slow,
        ),
    ],
    ids=["killed", "hung"],
)
def test_failed_worker_is_replaced_and_requests_replayed(
    tmp_path, qwen3_path, rank, sig, args, logged
):
    process, log, address = _start(tmp_path, qwen3_path, "--tp", "2", *args)
    old = child_pids(log.read_text())
    try:
        results = _disturbed_run(address, lambda: os.kill(old[f"worker rank {rank}"], sig))
        assert results == _expected(qwen3_path)
        assert process.poll() is None
        new = child_pids(log.read_text())
        assert all(new[f"worker rank {r}"] != old[f"worker rank {r}"] for r in (0, 1))
        assert not any(pid_alive(old[f"worker rank {r}"]) for r in (0, 1))
        # The new workers serve on.
        with EngineClient(address) as client:
            assert client.generate(PROMPTS[0], GREEDY).outputs[0].token_ids == results[0]
    finally:
        assert _stop(process) == 0, log.read_text()
    assert logged in log.read_text()


@pytest.mark.slow  # 19 s (the killed case above covers one restart)
@pytest.mark.gpus(2)
def test_restarts_are_bounded(tmp_path, qwen3_path):
    process, log, address = _start(tmp_path, qwen3_path, "--tp", "2", "--max-worker-restarts", "1")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        with EngineClient(address) as client:
            for kill in range(2):
                stream = client.stream(PROMPTS[0], params)
                next(stream)
                os.kill(child_pids(log.read_text())["worker rank 1"], signal.SIGKILL)
                if kill == 0:
                    assert len([t for d in stream for t in d.outputs[0].token_ids]) == 399
            with pytest.raises(RequestError, match="the engine failed") as failure:
                for _ in stream:
                    pass
        assert failure.value.code == ErrorCode.INTERNAL
        assert process.wait(timeout=30) != 0
    finally:
        if process.poll() is None:
            process.kill()
    assert "gave up after 1 worker restart(s) within 300 s" in log.read_text()


def test_sigterm_drains(tmp_path, llama_path):
    process, log, address = _start(tmp_path, llama_path, "--tp", "1")
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    with EngineClient(address) as client:
        stream = client.stream(PROMPTS[0], params)
        tokens = list(next(stream).outputs[0].token_ids)
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while "draining" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(RequestError, match="shutting down") as refused:
            client.generate(PROMPTS[1], params)
        assert refused.value.code == ErrorCode.UNAVAILABLE
        for delta in stream:
            tokens.extend(delta.outputs[0].token_ids)
        assert delta.outputs[0].finish_reason == "length"
    assert len(tokens) == 500
    assert process.wait(timeout=30) == 0
    assert "drained: every request finished" in log.read_text()


def _start_with_api(tmp_path, model: str):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ("--model", model, "--dtype", "float32", "--kv-cache-memory", "64MiB")
    process, log, address_file = start_launch(
        tmp_path, *args, "--api-host", "127.0.0.1", "--api-port", str(port)
    )
    wait_ready(process, log, address_file)
    return process, log, f"http://127.0.0.1:{port}"


def test_dead_api_server_is_restarted(tmp_path, llama_path):
    process, log, base_url = _start_with_api(tmp_path, llama_path)
    url = f"{base_url}/health"
    try:
        assert httpx.get(url).status_code == 200
        os.kill(child_pids(log.read_text())["api server"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url).status_code == 200:
                    break
            time.sleep(0.2)
        assert httpx.get(url).status_code == 200
        assert process.poll() is None
        assert "api server died with exit code -9; restarting it" in log.read_text()
    finally:
        assert _stop(process) == 0, log.read_text()


def test_engine_death_ends_http_streams_with_an_error_event(tmp_path, llama_path):
    process, log, base_url = _start_with_api(tmp_path, llama_path)
    body = {"prompt": PROMPTS[0], "max_tokens": 500, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=30) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ")
            started = time.monotonic()
            os.kill(child_pids(log.read_text())["engine core"], signal.SIGKILL)
            events = [line for line in lines if line.startswith("data: ")]
        assert time.monotonic() - started < 10
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: ") :])["error"]
        assert error["type"] == "service_unavailable" and "pid" not in error["message"]
        assert process.wait(timeout=30) != 0  # a dead engine takes the cluster down
    finally:
        if process.poll() is None:
            process.kill()
