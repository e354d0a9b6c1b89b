"""MultiprocExecutor against fake workers (raw DEALERs): the READY handshake, one encoded
SchedulerOutput for every rank, rank 0's answer, and failures that never hang."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq

from engine_core.multiproc_executor import MultiprocExecutor
from ipc.config import EngineConfig
from ipc.executor import WorkerFailure
from ipc.messages import (
    FinishStep,
    InitKVCache,
    KVCacheReady,
    ModelRunnerOutput,
    WorkerError,
    WorkerReady,
    encode,
)
from tests.cluster.fake_workers import (
    connect,
    decoder,
    init_kv_caches,
    one_token_step,
    worker_ready,
)


@pytest.fixture
def setup(tmp_path):
    address = f"ipc://{tmp_path}/engine"
    ctx = zmq.Context()
    created = []

    def make(tp: int = 2, **config):
        executor = MultiprocExecutor(
            EngineConfig(max_model_len=64, tensor_parallel_size=tp, **config),
            address,
            ready_timeout=0.5,
        )
        workers = [connect(ctx, address, f"fake-{rank}".encode()) for rank in range(tp)]
        created.append((executor, workers))
        return executor, workers

    yield make
    for executor, workers in created:
        executor.shutdown()
        for sock in workers:
            sock.close()
    ctx.term()


def _ready(workers, blocks, pids=None):
    for rank, sock in enumerate(workers):
        sock.send(worker_ready(rank, blocks[rank], None if pids is None else pids[rank]))


def _registered(setup):
    """An executor whose two workers registered and allocated their KV caches."""
    executor, workers = setup()
    _ready(workers, [8, 8])
    init_kv_caches(executor.initialize_workers, workers)
    return executor, workers


@pytest.mark.parametrize(("override", "expected"), [(None, 30), (20, 20), (99, 30)])
def test_every_rank_gets_the_smallest_block_count(setup, override, expected):
    executor, workers = setup(num_gpu_blocks_override=override)
    _ready(workers, [50, 30])
    spec, inits = init_kv_caches(executor.initialize_workers, workers)
    assert spec.num_kv_blocks == expected and inits == [InitKVCache(expected)] * 2


def test_the_executor_is_ready_only_once_every_rank_has_its_kv_cache(setup):
    """initialize_workers returns (and the engine reports ready) only after every rank's
    KVCacheReady, so the first step never waits for a cache being allocated."""
    executor, workers = setup()
    _ready(workers, [8, 8])
    with ThreadPoolExecutor(1) as pool:
        spec = pool.submit(executor.initialize_workers)
        for sock in workers:
            assert sock.poll(5000) and decoder.decode(sock.recv()) == InitKVCache(8)
        workers[0].send(encode(KVCacheReady(0)))
        workers[1].send(encode(ModelRunnerOutput(0, ["a"], [[1]])))  # not an answer to it
        assert not workers[1].poll(150)
        assert not spec.done()
        workers[1].send(encode(KVCacheReady(1)))
        assert spec.result(timeout=5).num_kv_blocks == 8


def test_a_rank_that_never_allocates_its_kv_cache_times_out(setup):
    executor, workers = setup()
    _ready(workers, [8, 8])
    with pytest.raises(WorkerFailure, match=r"rank\(s\) \[0, 1\] to allocate their KV cache"):
        executor.initialize_workers()


def test_the_host_tier_is_the_smallest_over_ranks_and_the_costs_the_largest(setup):
    executor, workers = setup()
    for rank, sock in enumerate(workers):
        ready = WorkerReady(
            rank,
            40,
            os.getpid(),
            socket.gethostname(),
            num_host_blocks=[90, 70][rank],
            block_copy_seconds=[2e-5, 1e-5][rank],
            prefill_token_seconds=[3e-4, 5e-4][rank],
        )
        sock.send(encode(ready))
    spec, inits = init_kv_caches(executor.initialize_workers, workers)
    assert (spec.num_kv_blocks, spec.num_host_blocks) == (40, 70)
    assert inits == [InitKVCache(40, 70)] * 2
    assert (spec.block_copy_seconds, spec.prefill_token_seconds) == (2e-5, 5e-4)


@pytest.mark.parametrize("new_host_blocks", [70, 69])
def test_new_workers_get_the_host_blocks_in_use_or_fail_holding_fewer(setup, new_host_blocks):
    executor, workers = setup()
    for rank, sock in enumerate(workers):
        sock.send(encode(WorkerReady(rank, 40, os.getpid(), "", num_host_blocks=70)))
    spec, _ = init_kv_caches(executor.initialize_workers, workers)
    in_use = dataclasses.replace(spec, num_kv_blocks=30)
    ctx = zmq.Context()
    fresh = []
    try:
        for rank in range(2):
            sock = connect(ctx, executor.address)
            blocks = [new_host_blocks, 80][rank]
            sock.send(encode(WorkerReady(rank, 40, os.getpid(), "", num_host_blocks=blocks)))
            fresh.append(sock)
        if new_host_blocks < 70:
            with pytest.raises(WorkerFailure, match="hold 69 host KV blocks, fewer than the 70"):
                executor.replace_workers(in_use)
        else:
            _, inits = init_kv_caches(lambda: executor.replace_workers(in_use), fresh)
            assert inits == [InitKVCache(30, 70)] * 2
    finally:
        for sock in fresh:
            sock.close()
        ctx.term()


def test_a_step_sends_the_same_bytes_and_returns_rank_0s_answer(setup):
    executor, workers = _registered(setup)
    answer = ModelRunnerOutput(0, ["a"], [[7]])
    workers[1].send(encode(ModelRunnerOutput(0, ["a"], [[666]])))  # not the driver: ignored
    workers[0].send(encode(answer))
    assert executor.execute_model(one_token_step(0)) == answer
    frames = [sock.recv() for sock in workers]
    assert frames[0] == frames[1] == encode(one_token_step(0))


def test_workers_are_told_to_finish_a_step_only_when_no_later_step_was_sent(setup):
    """Under async scheduling the EngineCore may wait for a step it sent without
    `lockstep` after all (the next schedule came out empty)."""
    executor, workers = _registered(setup)
    executor.submit(one_token_step(0))
    executor.submit(one_token_step(1))
    workers[0].send(encode(ModelRunnerOutput(0, ["a"], [[7]])))
    assert executor.collect(one_token_step(0)).step_id == 0  # step 1 was sent: no FinishStep
    workers[0].send(encode(ModelRunnerOutput(1, ["a"], [[8]])))
    assert executor.collect(one_token_step(1)).step_id == 1
    for sock in workers:
        frames = [decoder.decode(sock.recv()) for _ in range(3)]
        assert frames == [one_token_step(0), one_token_step(1), FinishStep(1)] and not sock.poll(50)


def test_a_step_sent_in_lockstep_needs_no_finish_step(setup):
    executor, workers = _registered(setup)
    step = one_token_step(0)
    step.lockstep = True
    workers[0].send(encode(ModelRunnerOutput(0, ["a"], [[7]])))
    assert executor.execute_model(step).step_id == 0
    for sock in workers:
        assert decoder.decode(sock.recv()) == step and not sock.poll(50)


def test_a_worker_error_names_its_rank(setup):
    executor, workers = _registered(setup)
    workers[1].send(encode(WorkerError(1, "Traceback ...\nValueError: boom", 0)))
    with pytest.raises(WorkerFailure, match=r"(?s)worker rank 1 failed at step 0:\n.*boom"):
        executor.execute_model(one_token_step(0))


def test_a_dead_worker_is_noticed_while_waiting(setup):
    executor, workers = setup()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _ready(workers, [8, 8], pids=[os.getpid(), dead.pid])
    init_kv_caches(executor.initialize_workers, workers)
    with pytest.raises(WorkerFailure, match=rf"worker rank 1 \(pid {dead.pid}\) died"):
        executor.execute_model(one_token_step(0))


def test_a_missing_worker_times_out_with_a_clear_error(setup):
    executor, workers = setup()
    _ready(workers[:1], [8])
    with pytest.raises(WorkerFailure, match=r"no WorkerReady from rank\(s\) \[1\]"):
        executor.initialize_workers()
