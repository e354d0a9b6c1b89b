"""The scheduler tests' stand-in workers (tests/engine_core/stand_in_executor.py) keep their
own view of every request, built from the SchedulerOutputs as update_batch (worker/batch_update.py)
builds the real one. Here one EngineCore drives both with the same SchedulerOutputs
(chunked prefills, prefix-cache hits, preemption and resumption, aborts, replaced
workers), the stand-in sampling what the real runner sampled; after every step each
request's tokens, block ids and computed tokens agree, in the runner's request states
and in its persistent batch alike."""

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from engine_core import EngineConfig, EngineCore, Executor
from ipc.executor import WorkerFailure, WorkerGroupSpec
from ipc.messages import EngineCoreRequest, ModelRunnerOutput, SchedulerOutput
from ipc.sampling_params import SamplingParams
from tests.engine_core.stand_in_executor import StandInExecutor
from worker.model_runner import ModelRunner

BLOCK_SIZE = 4


@dataclass
class TwinExecutor(Executor):
    """Runs each step on a real ModelRunner, then on the stand-in, and compares their
    views of the requests. Steps in `fail_steps` fail before either runs."""

    config: EngineConfig
    num_blocks: int
    fail_steps: set[int] = field(default_factory=set)
    runner: ModelRunner = field(init=False)
    stand_in: StandInExecutor = field(init=False)

    def __post_init__(self) -> None:
        self.runner = self._new_runner()
        self.stand_in = StandInExecutor(self.num_blocks)

    def _new_runner(self) -> ModelRunner:
        runner = ModelRunner(self.config)
        runner.initialize_kv_cache(self.num_blocks)
        return runner

    def initialize_workers(self) -> WorkerGroupSpec:
        return WorkerGroupSpec(self.num_blocks)

    def replace_workers(self, spec: WorkerGroupSpec) -> None:
        self.runner = self._new_runner()
        self.stand_in.replace_workers(spec)

    def shutdown(self) -> None:
        self.stand_in.shutdown()

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if so.step_id in self.fail_steps:
            self.fail_steps.discard(so.step_id)
            raise WorkerFailure(f"workers died at step {so.step_id}")
        real = self.runner.execute_model(so)
        sampled = dict(zip(real.req_ids, real.sampled_token_ids, strict=True))
        self.stand_in.sample = lambda request_id, _: sampled[request_id][0]
        twin = self.stand_in.execute_model(so)
        assert dict(zip(twin.req_ids, twin.sampled_token_ids, strict=True)) == sampled
        self._check_views(so)
        return real

    def _check_views(self, so: SchedulerOutput) -> None:
        """The stand-in counts a step's tokens as computed once it ran; the runner keeps
        the scheduler's count from before the step (and, for a request not scheduled,
        from before the last step that ran it: the next SchedulerOutput that schedules it
        says anew)."""
        runner, states = self.runner, self.stand_in.states
        assert runner.requests.keys() == states.keys()
        for request_id, twin in states.items():
            real = runner.requests[request_id]
            assert real.prompt_token_ids + real.output_token_ids == twin.token_ids
            assert real.block_ids == twin.block_ids
            if request_id in so.num_scheduled_tokens:
                computed = real.num_computed_tokens + so.num_scheduled_tokens[request_id]
                assert computed == twin.num_computed_tokens
        batch = runner.input_batch
        assert batch.req_id_to_index.keys() == so.num_scheduled_tokens.keys()
        for request_id, row in batch.req_id_to_index.items():
            twin = states[request_id]
            assert batch.token_ids[row, : batch.num_tokens[row]].tolist() == twin.token_ids
            for table, ids in zip(batch.block_table.groups, twin.block_ids, strict=True):
                assert table.np[row, : table.num_blocks_per_row[row]].tolist() == ids
            computed = batch.num_computed_tokens[row] + so.num_scheduled_tokens[request_id]
            assert computed == twin.num_computed_tokens


def _request(request_id: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(request_id, prompt, params, 0.0)


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 37 + 11 * i) % 256 for i in range(length)]


SHARED = _prompt(1, 12)
Event = Callable[[EngineCore], None]


def _add(request_id: str, prompt: list[int], max_tokens: int = 6) -> Event:
    return lambda engine: engine.add_request(_request(request_id, prompt, max_tokens))


def _abort(request_id: str) -> Event:
    return lambda engine: engine.abort_requests([request_id])


def _any_new(outputs, check) -> bool:
    return any(check(so, new) for so in outputs for new in so.scheduled_new_reqs)


def _chunked(outputs) -> bool:
    def partial(so, new):
        return so.num_scheduled_tokens[new.req_id] < len(new.prompt_token_ids)

    return _any_new(outputs, partial)


def _prefix_hit(outputs) -> bool:
    return _any_new(outputs, lambda so, new: new.num_computed_tokens > 0)


def _resumed(outputs) -> bool:
    return any(any(so.scheduled_cached_reqs.resumed_from_preemption) for so in outputs)


def _replayed_with_outputs(outputs) -> bool:
    return _any_new(outputs, lambda so, new: len(new.output_token_ids) > 0)


def _finished_sent(outputs) -> bool:
    return any(so.finished_req_ids for so in outputs)


# name: (engine settings, KV blocks, steps whose workers die, {step: events}, what must happen)
SCENARIOS = {
    "chunked_prefill": (
        {"max_num_batched_tokens": 8},
        64,
        set(),
        {0: [_add("a", _prompt(2, 19)), _add("b", _prompt(3, 9)), _add("c", _prompt(4, 3))]},
        _chunked,
    ),
    "prefix_hits": (
        {"max_num_batched_tokens": 16},
        64,
        set(),
        {0: [_add("a", SHARED + [1, 2])], 3: [_add("b", SHARED + [3]), _add("c", SHARED)]},
        _prefix_hit,
    ),
    "preemption": (
        {"max_num_batched_tokens": 16, "max_model_len": 32},
        12,
        set(),
        {0: [_add(r, _prompt(i + 5, 10), max_tokens=18) for i, r in enumerate("abc")]},
        _resumed,
    ),
    "aborts": (
        {"max_num_batched_tokens": 16},
        64,
        set(),
        {0: [_add("a", _prompt(6, 5), 20), _add("b", _prompt(7, 7), 20)], 4: [_abort("a")]},
        _finished_sent,
    ),
    "replaced_workers": (
        {"max_num_batched_tokens": 16},
        64,
        {4},
        {0: [_add("a", _prompt(8, 6), 10), _add("b", _prompt(9, 13), 10)]},
        _replayed_with_outputs,
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_stand_in_keeps_the_runners_view_of_every_request(checkpoint, name):
    settings, num_blocks, fail_steps, events, happened = SCENARIOS[name]
    config = EngineConfig(
        model=checkpoint,
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        **{"max_model_len": 64, **settings},
    )
    executor = TwinExecutor(config, num_blocks, set(fail_steps))
    engine = EngineCore(config, executor)
    executor.stand_in.kv_cache_manager = engine.kv_cache_manager
    for step in range(200):
        for event in events.get(step, []):
            event(engine)
        if step > max(events) and not engine.has_unfinished_requests():
            break
        engine.step()
    else:
        raise AssertionError("the engine did not finish")
    assert happened(executor.stand_in.outputs), f"{name}: the scenario missed its point"
