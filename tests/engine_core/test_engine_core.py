"""EngineCore wiring: KV cache size, prefix cache reset, shutdown."""

import subprocess
import sys
from pathlib import Path

import pytest
from stand_in_executor import (
    StandInExecutor,
    make_config,
    make_engine,
    make_request,
    run_to_completion,
)

from engine_core import EngineCore, Scheduler


def test_the_kv_cache_takes_the_executor_block_count():
    engine = EngineCore(make_config(), StandInExecutor(40))
    assert engine.kv_cache_manager.block_pool.num_blocks == 40


@pytest.mark.parametrize(
    ("device_type", "processes", "given", "budget", "overlaps"),
    [
        ("cpu", False, None, 2048, False),
        ("cpu", True, None, 2048, True),
        ("cuda", False, None, 8192, True),
        ("cuda", True, 48, 48, True),
    ],
)
def test_the_workers_device_picks_the_default_token_budget_and_overlap(
    device_type, processes, given, budget, overlaps
):
    """A budget not given is the default for the device the workers reported; a given one
    holds. GPU workers and workers in processes of their own overlap steps, so async
    scheduling is on there by default; CPU workers in the EngineCore's process do not."""
    executor = StandInExecutor(40)
    executor.device_type = device_type
    executor.worker_processes = processes
    engine = EngineCore(make_config(max_num_batched_tokens=given), executor)
    assert engine.scheduler.max_num_batched_tokens == budget
    assert engine.config.max_num_batched_tokens == budget
    assert (engine.max_in_flight > 0) == overlaps


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_each_step_says_whether_the_engine_waits_for_its_answer(monkeypatch, async_scheduling):
    """SchedulerOutput.lockstep: always without async scheduling; with it, only while the
    scheduler needs lockstep (a structured-output request is live)."""
    needs_lockstep = [False]
    monkeypatch.setattr(Scheduler, "needs_lockstep", property(lambda self: needs_lockstep[0]))
    engine, executor = make_engine(async_scheduling=async_scheduling)
    engine.add_request(make_request("a", 5, max_tokens=8))
    for _ in range(3):
        engine.step()
    needs_lockstep[0] = True
    run_to_completion(engine)
    flags = [so.lockstep for so in executor.outputs]
    if async_scheduling:
        assert flags == [False] * 3 + [True] * (len(flags) - 3)
    else:
        assert flags == [True] * len(flags)


def test_a_kv_cache_too_small_for_one_request_is_refused():
    # max_model_len 64 in blocks of 4 needs 16 blocks besides the null block.
    EngineCore(make_config(), StandInExecutor(17))
    with pytest.raises(ValueError, match="max_model_len=64"):
        EngineCore(make_config(), StandInExecutor(16))


def test_reset_prefix_cache_forgets_cached_prompts():
    engine, executor = make_engine()
    prompt = list(range(1000, 1009))
    engine.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(engine)
    assert engine.reset_prefix_cache()
    engine.add_request(make_request("b", prompt, max_tokens=1))
    run_to_completion(engine)
    assert executor.outputs[-1].scheduled_new_reqs[0].num_computed_tokens == 0


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use():
    engine, _ = make_engine()
    engine.add_request(make_request("a", 9, max_tokens=4))
    engine.step()
    assert not engine.reset_prefix_cache()


def test_shutdown_reaches_the_executor():
    engine, executor = make_engine()
    engine.add_request(make_request("a", 9, max_tokens=4))
    engine.step()
    engine.shutdown()
    assert executor.states == {}


def test_engine_core_imports_no_torch_nor_worker_packages():
    code = (
        "import sys, engine_core, engine_core.core; "
        "print(sorted({'torch', 'worker', 'models', 'attention', 'server'} & sys.modules.keys()))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.stdout.strip() == "[]"


class Clock:
    """time.monotonic for the EngineCore: the test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_finished_request_carries_its_queue_prefill_and_decode_times(monkeypatch):
    """Only the last output of a request has its RequestStats: from being taken to its
    first scheduling, from then to its first token, from that to its last. With one
    request at a time, b waits for a's three steps; each step here takes a second."""
    clock = Clock()
    monkeypatch.setattr("engine_core.request.time.monotonic", clock)
    monkeypatch.setattr("engine_core.scheduler.time.monotonic", clock)
    engine, _ = make_engine(max_num_seqs=1)
    engine.add_request(make_request("a", 5, max_tokens=3))
    engine.add_request(make_request("b", 5, max_tokens=2))
    times = {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            if out.finish_reason is None:
                assert out.request_stats is None
            else:
                times[out.request_id] = out.request_stats
        clock.now += 1.0
    assert (times["a"].queued, times["a"].prefill, times["a"].decode) == (0.0, 0.0, 2.0)
    assert (times["b"].queued, times["b"].prefill, times["b"].decode) == (3.0, 0.0, 1.0)


def test_a_chunked_prefill_counts_its_steps_as_prefill_time(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("engine_core.request.time.monotonic", clock)
    monkeypatch.setattr("engine_core.scheduler.time.monotonic", clock)
    engine, _ = make_engine(max_num_batched_tokens=16)
    engine.add_request(make_request("long", 40, max_tokens=2))  # prefill in 3 chunks
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            if out.finish_reason is not None:
                times = out.request_stats
        clock.now += 1.0
    assert (times.queued, times.prefill, times.decode) == (0.0, 2.0, 1.0)
