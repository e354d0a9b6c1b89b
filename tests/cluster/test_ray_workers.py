"""`launch.py --distributed-executor-backend ray`: the workers as Ray actors, on a Ray
cluster of two nodes made by Ray's own test helper (one CPU each, so the two ranks land
on different nodes). The group answers as processes do, and a worker that dies is
replaced through Ray. Skipped where Ray is not installed (an optional dependency)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ipc.client import EngineClient
from ipc.sampling_params import SamplingParams
from tests.cluster.helpers import child_pids, start_launch, wait_ready
from tests.integration.greedy import greedy_reference

ray_cluster_utils = pytest.importorskip("ray.cluster_utils")

PROMPTS = [[5, 77, 3, 200], [42] * 30]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture
def ray_nodes(monkeypatch):
    cluster = ray_cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    yield cluster
    cluster.shutdown()


def test_ray_workers_on_two_nodes_answer_and_are_replaced(tmp_path, llama_path, ray_nodes):
    args = ["--model", llama_path, "--dtype", "float32", "--kv-cache-memory", "64MiB"]
    args += ["--tp", "2", "--distributed-executor-backend", "ray", "--engine-host", "127.0.0.1"]
    process, log, address_file = start_launch(tmp_path, *args, "--no-api")
    try:
        wait_ready(process, log, address_file)
        expected = [greedy_reference(llama_path, ignore_eos=False)(p, 8) for p in PROMPTS]
        with EngineClient(str(address_file)) as client:
            assert [client.generate(p, GREEDY).outputs[0].token_ids for p in PROMPTS] == expected
            os.kill(child_pids(log.read_text())["worker rank 1"], signal.SIGKILL)
            deadline = time.monotonic() + 120
            while "asked for new workers" not in log.read_text():
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            assert [client.generate(p, GREEDY).outputs[0].token_ids for p in PROMPTS] == expected
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, log.read_text()
