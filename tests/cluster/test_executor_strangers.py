"""MultiprocExecutor against fake workers and a stranger (raw DEALERs): once the workers
registered, nobody else is heard, and a second WorkerReady is ignored, never fatal."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq

from engine_core.multiproc_executor import MultiprocExecutor
from ipc.config import EngineConfig
from ipc.messages import (
    ModelRunnerOutput,
    WorkerError,
    encode,
)
from tests.cluster.fake_workers import (
    answer_init_kv_caches,
    connect,
    one_token_step,
    worker_ready,
)


@pytest.fixture
def cluster(tmp_path):
    """An executor for tp 2 and three DEALERs: fake ranks 0 and 1, and a stranger."""
    address = f"ipc://{tmp_path}/engine"
    executor = MultiprocExecutor(
        EngineConfig(max_model_len=64, tensor_parallel_size=2), address, ready_timeout=2.0
    )
    ctx = zmq.Context()
    peers = [connect(ctx, address, name) for name in (b"fake-0", b"fake-1", b"stranger")]
    yield executor, peers
    executor.shutdown()
    for sock in peers:
        sock.close()
    ctx.term()


def test_a_second_worker_ready_for_a_rank_is_ignored(cluster, caplog):
    executor, (rank0, rank1, stranger) = cluster
    with ThreadPoolExecutor(1) as pool:
        spec = pool.submit(executor.initialize_workers)
        rank0.send(worker_ready(0, blocks=8))
        rank0.send(worker_ready(1, blocks=1))  # the same peer again, as another rank
        stranger.send(worker_ready(0, blocks=1))  # another peer for a rank that is taken
        time.sleep(0.3)  # all three are read before rank 1 registers
        rank1.send(worker_ready(1, blocks=8))
        answer_init_kv_caches([rank0, rank1])
        assert spec.result().num_kv_blocks == 8
    assert [w.identity for w in executor.workers] == [b"fake-0", b"fake-1"]
    assert caplog.text.count("ignored a second WorkerReady") == 2


def test_after_registration_a_stranger_is_not_heard(cluster, caplog):
    executor, (rank0, rank1, stranger) = cluster
    with ThreadPoolExecutor(1) as pool:
        spec = pool.submit(executor.initialize_workers)
        rank0.send(worker_ready(0))
        rank1.send(worker_ready(1))
        answer_init_kv_caches([rank0, rank1])
        assert spec.result().num_kv_blocks == 8
    stranger.send(encode(WorkerError(0, "forged", 0)))
    stranger.send(worker_ready(0))
    executor.check_workers()  # a WorkerError from a worker would raise here
    stranger.send(encode(WorkerError(1, "forged", 0)))
    stranger.send(encode(ModelRunnerOutput(0, ["a"], [[666]])))
    answer = ModelRunnerOutput(0, ["a"], [[7]])
    rank0.send(encode(answer))
    assert executor.execute_model(one_token_step(0)) == answer
    assert caplog.text.count("not a registered worker") == 1  # once per stranger
