"""Chaos: a tp-2 cluster with its HTTP server takes 2,100 requests from ZMQ and HTTP clients
at once — greedy requests checked against transformers, streams dropped mid-way, aborts,
bad requests — while a worker is SIGKILLed in the middle. Every request that was not
aborted or refused completes with the right tokens; afterwards nothing runs, every KV
block is free, and launch.py is still up (and exits cleanly on SIGTERM)."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import httpx
import pytest

from ipc.client import EngineClient, RequestError
from ipc.messages import ErrorCode
from ipc.sampling_params import SamplingParams
from ipc.sockets import free_tcp_port
from tests.cluster.helpers import child_pids, start_launch, wait_idle, wait_ready
from tests.integration.greedy import greedy_reference

pytestmark = pytest.mark.slow

NUM_ZMQ_THREADS = 6
NUM_HTTP_THREADS = 6
REQUESTS_PER_THREAD = 175  # 12 x 175 = 2,100
KILL_AFTER = 600  # requests finished before the worker is killed
MAX_TOKENS = 8
VOCAB_SIZE = 288  # the tiny checkpoint's
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(3, 256) for _ in range(_rng.randrange(3, 40))] for _ in range(16)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.failures: list[str] = []
        self.finished = 0

    def add(self, kind: str, failure: str | None = None) -> None:
        with self.lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.finished += 1
            if failure is not None:
                self.failures.append(f"{kind}: {failure}")


def _zmq_worker(client: EngineClient, seed: int, expected, tally: Tally) -> None:
    rng = random.Random(seed)
    for _ in range(REQUESTS_PER_THREAD):
        i = rng.randrange(len(PROMPTS))
        roll = rng.random()
        try:
            if roll < 0.7:
                tokens = client.generate(PROMPTS[i], GREEDY).outputs[0].token_ids
                tally.add("zmq ok", None if tokens == expected[i][0] else f"prompt {i}: {tokens}")
            elif roll < 0.8:
                stream = client.stream(PROMPTS[i], GREEDY)
                next(stream)
                stream.close()  # aborts it in the engine
                tally.add("zmq dropped")
            elif roll < 0.9:
                bad = PROMPTS[i] + [VOCAB_SIZE + rng.randrange(10**6)]
                try:
                    client.generate(bad, GREEDY)
                    tally.add("zmq bad", "an out-of-vocabulary prompt was served")
                except RequestError as e:
                    ok = e.code == ErrorCode.INVALID_REQUEST
                    tally.add("zmq bad", None if ok else f"{e.code}: {e}")
            else:
                params = SamplingParams(min_tokens=2, stop_token_ids=[VOCAB_SIZE + 1])
                try:
                    client.generate(PROMPTS[i], params)
                    tally.add("zmq bad stop id", "an out-of-vocabulary stop id was served")
                except RequestError:
                    tally.add("zmq bad stop id")
        except Exception as e:  # anything else is a failure of the cluster
            tally.add("zmq error", repr(e))


def _http_worker(url: str, seed: int, expected, tally: Tally) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=120) as http:
        for _ in range(REQUESTS_PER_THREAD):
            i = rng.randrange(len(PROMPTS))
            body = {"prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0.0}
            roll = rng.random()
            try:
                if roll < 0.7:
                    reply = http.post("/v1/completions", json=body)
                    text = reply.json()["choices"][0]["text"] if reply.status_code == 200 else None
                    failure = None if text == expected[i][1] else f"{reply.status_code} {text!r}"
                    tally.add("http ok", failure)
                elif roll < 0.8:
                    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                        next(r.iter_lines())
                    tally.add("http dropped")  # closing the connection aborts it
                elif roll < 0.9:
                    bad = {**body, "min_tokens": 1, "stop_token_ids": [VOCAB_SIZE + 7]}
                    reply = http.post("/v1/completions", json=bad)
                    tally.add("http bad", None if reply.status_code == 400 else reply.text)
                else:
                    reply = http.post(
                        "/v1/completions",
                        content=b'{"prompt": [1, 2',
                        headers={"content-type": "application/json"},
                    )
                    tally.add("http garbage", None if reply.status_code == 400 else reply.text)
            except Exception as e:
                tally.add("http error", repr(e))


@pytest.mark.gpus(2)
def test_chaos(tmp_path, qwen3_path):
    port = free_tcp_port(count=1)
    args = ("--model", qwen3_path, "--tp", "2", "--dtype", "float32")
    args += ("--kv-cache-memory", "64MiB", "--api-host", "127.0.0.1", "--api-port", str(port))
    process, log, address_file = start_launch(tmp_path, *args)
    address = wait_ready(process, log, address_file)
    url = f"http://127.0.0.1:{port}"
    tally = Tally()
    try:
        assert httpx.get(f"{url}/health").status_code == 200  # "ready" means ready
        greedy = greedy_reference(qwen3_path, ignore_eos=False)
        tokens = [greedy(p, MAX_TOKENS) for p in PROMPTS]
        with EngineClient(address, tokenizer=qwen3_path) as client:
            outputs = [client.generate(p, GREEDY).outputs[0] for p in PROMPTS]
            assert [o.token_ids for o in outputs] == tokens
            expected = [(o.token_ids, o.text) for o in outputs]
            with EngineClient(address) as second:
                threads = [
                    threading.Thread(
                        target=_zmq_worker, args=((client, second)[n % 2], n, expected, tally)
                    )
                    for n in range(NUM_ZMQ_THREADS)
                ]
                threads += [
                    threading.Thread(target=_http_worker, args=(url, 100 + n, expected, tally))
                    for n in range(NUM_HTTP_THREADS)
                ]
                started = time.monotonic()
                for thread in threads:
                    thread.start()
                while tally.finished < KILL_AFTER and time.monotonic() - started < 300:
                    time.sleep(0.05)
                os.kill(child_pids(log.read_text())["worker rank 1"], signal.SIGKILL)
                for thread in threads:
                    thread.join(timeout=600)
            stats = wait_idle(client, timeout=30)
        assert tally.failures == []
        assert tally.finished == (NUM_ZMQ_THREADS + NUM_HTTP_THREADS) * REQUESTS_PER_THREAD
        assert stats.num_running == stats.num_waiting == 0
        assert stats.kv_cache_usage == 0.0
        assert process.poll() is None
        assert "replacing the workers (restart 1)" in log.read_text()
        print(json.dumps(tally.counts, sort_keys=True), f"{time.monotonic() - started:.1f} s")
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
    assert code == 0, log.read_text()[-3000:]
