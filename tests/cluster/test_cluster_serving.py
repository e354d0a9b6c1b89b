"""A running cluster (launch.py, tp 2 and tp 1) serves EngineClients exactly as
transformers' greedy generate answers, whoever sends the requests."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ipc.client import EngineClient
from ipc.sampling_params import SamplingParams
from tests.cluster.helpers import ROOT, cluster_env, wait_idle
from tests.integration.greedy import greedy_reference

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(256) for _ in range(n)] for n in (3, 17, 40, 9, 25, 64)]

_CLIENT_SCRIPT = """
import json, sys
from ipc.client import EngineClient
from ipc.sampling_params import SamplingParams
address, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
with EngineClient(address) as client:
    print(json.dumps([client.generate(p, params).outputs[0].token_ids for p in prompts]))
"""

_references: dict[str, list[list[int]]] = {}


def reference(model: str) -> list[list[int]]:
    if model not in _references:
        greedy = greedy_reference(model, ignore_eos=False)
        _references[model] = [greedy(p, MAX_TOKENS) for p in PROMPTS]
    return _references[model]


def test_greedy_from_threads_equals_transformers(cluster):
    results: dict[int, list[int]] = {}
    with EngineClient(cluster.address) as client:

        def submit(indices: list[int]) -> None:
            for i in indices:
                results[i] = client.generate(PROMPTS[i], GREEDY).outputs[0].token_ids

        threads = [threading.Thread(target=submit, args=([i, i + 3],)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [results[i] for i in range(len(PROMPTS))] == reference(cluster.model)


def test_greedy_from_two_client_processes(cluster):
    halves = [PROMPTS[0::2], PROMPTS[1::2]]
    script = [sys.executable, "-c", _CLIENT_SCRIPT, cluster.address]
    clients = [
        subprocess.Popen(
            [*script, json.dumps(half), str(MAX_TOKENS)],
            stdout=subprocess.PIPE,
            env=cluster_env(),
            cwd=ROOT,
        )
        for half in halves
    ]
    answers = [json.loads(c.communicate(timeout=60)[0]) for c in clients]
    expected = reference(cluster.model)
    assert answers == [expected[0::2], expected[1::2]]


def test_stream_yields_the_blocking_tokens(cluster):
    with EngineClient(cluster.address) as client:
        deltas = list(client.stream(PROMPTS[2], GREEDY))
        blocking = client.generate(PROMPTS[2], GREEDY)
    assert [t for d in deltas for t in d.outputs[0].token_ids] == blocking.outputs[0].token_ids
    assert len(deltas) > 1 and deltas[-1].finished
    assert blocking.outputs[0].token_ids == reference(cluster.model)[2]


def test_abort_mid_stream_frees_the_request(cluster):
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    with EngineClient(cluster.address) as client:
        generated_before = wait_idle(client).num_generation_tokens
        stream = client.stream(PROMPTS[1], params)
        for _, delta in zip(range(3), stream, strict=False):
            assert not delta.finished
        stats = client.stats()
        assert stats.num_running == 1 and stats.kv_cache_usage > 0
        stream.close()  # closing the stream aborts the request in the engine
        stats = wait_idle(client)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_cache_usage == 0.0
    assert stats.num_generation_tokens - generated_before < 100  # cut short, not finished


def test_stop_string_truncates(cluster):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    with EngineClient(cluster.address, tokenizer=cluster.model) as client:
        # Random tiny models babble; find a prompt whose answer has a clean 2-character
        # stop string first found after its start.
        for prompt in (list(b"abc"), list(b"The quick brown fox"), list(b"0123456789")):
            full = client.generate(prompt, params).outputs[0].text
            cuts = [i for i in range(2, len(full) - 1) if _clean(full[i : i + 2])]
            if cuts:
                break
        else:
            pytest.fail("no answer with a usable stop string")
        stop = full[cuts[0] : cuts[0] + 2]
        stop_params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
        stopped = client.generate(prompt, stop_params).outputs[0]
        assert stopped.text == full[: full.index(stop)]
        assert stopped.finish_reason == "stop"
        assert len(stopped.token_ids) < 30
        assert wait_idle(client).num_running == 0


def _clean(text: str) -> bool:
    return "\ufffd" not in text and not text.isspace()


def test_engine_process_never_loads_torch(cluster):
    def mapped(name: str) -> str:
        return Path(f"/proc/{cluster.pids[name]}/maps").read_text()

    assert "libtorch" in mapped("worker rank 0")
    assert "libtorch" not in mapped("engine core")
