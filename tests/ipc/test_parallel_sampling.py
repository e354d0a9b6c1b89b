"""Parallel sampling in the clients (ipc/client/parallel_sampling.py): a request with n or
best_of > 1 fans out into child requests and their outputs fold back into one
RequestOutput. Driven sans-IO through ClientCore (scripted engine outputs), then end to
end through both clients against the scripted FakeEngine."""

import asyncio
import queue

import pytest

from ipc.client import AsyncEngineClient, EngineClient, RequestError
from ipc.client.output_processor import OutputProcessor
from ipc.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    TokenLogprobs,
    encode,
)
from ipc.sampling_params import SamplingParams
from tests.ipc.client_fakes import FakeEngine

PROMPT = [5, 6, 7]


def drain(q: queue.SimpleQueue) -> list:
    items = []
    while not q.empty():
        items.append(q.get_nowait())
    return items


def out(request_id, tokens, finish=None, logprobs=None, **kw) -> EngineCoreOutputs:
    return EngineCoreOutputs([EngineCoreOutput(request_id, tokens, finish, 0, logprobs, **kw)])


def test_children_have_n_1_and_their_own_seed(core):
    params = SamplingParams(n=3, seed=40, max_tokens=5)
    core.submit(queue.SimpleQueue(), PROMPT, params, "p", 0, "salt")
    sent = [m for m in core.sent if isinstance(m, EngineCoreRequest)]
    assert [m.request_id for m in sent] == ["0_p", "1_p", "2_p"]
    assert [m.sampling_params.seed for m in sent] == [40, 41, 42]
    for m in sent:
        assert m.sampling_params.n == 1 and m.sampling_params.best_of is None
        assert m.sampling_params.logprobs is None and m.sampling_params.max_tokens == 5
        assert (m.prompt_token_ids, m.cache_salt) == (PROMPT, "salt")


def test_unseeded_children_stay_unseeded_and_best_of_asks_for_logprobs(core):
    core.submit(queue.SimpleQueue(), PROMPT, SamplingParams(n=2, best_of=4), "p", 0, None)
    sent = [m for m in core.sent if isinstance(m, EngineCoreRequest)]
    assert len(sent) == 4
    assert all(m.sampling_params.seed is None for m in sent)
    assert all(m.sampling_params.logprobs == 0 for m in sent)


def test_deltas_carry_the_choice_index_and_the_parent_finishes_with_the_last_child(core):
    q = queue.SimpleQueue()
    state = core.submit(q, PROMPT, SamplingParams(n=2), "p", 0, None)
    core.process_outputs(out("1_p", [9]))
    core.process_outputs(out("0_p", [8], FinishReason.LENGTH))
    core.process_outputs(out("1_p", [10], FinishReason.STOP))
    deltas = drain(q)
    assert [(d.request_id, d.outputs[0].index, d.outputs[0].token_ids) for d in deltas] == [
        ("p", 1, [9]),
        ("p", 0, [8]),
        ("p", 1, [10]),
    ]
    assert [d.finished for d in deltas] == [False, False, True]
    assert [d.outputs[0].finish_reason for d in deltas] == [None, "length", "stop"]
    result = state.result
    assert result.finished and result.request_id == "p"
    assert [(c.index, c.token_ids) for c in result.outputs] == [(0, [8]), (1, [9, 10])]
    # Nothing is left live: the id can be used again.
    core.submit(queue.SimpleQueue(), PROMPT, None, "p", 0, None)


def test_aborting_the_parent_aborts_every_child(core):
    q = queue.SimpleQueue()
    core.submit(q, PROMPT, SamplingParams(n=3), "p", 0, None)
    core.process_outputs(out("2_p", [1], FinishReason.LENGTH))
    assert core.abort("p")
    assert core.sent[-1] == AbortRequests(["0_p", "1_p", "2_p"])
    last = drain(q)[-1]
    assert last.finished
    assert [(c.index, c.finish_reason) for c in last.outputs] == [(0, "abort"), (1, "abort")]
    assert not core.abort("p")


def test_a_child_cannot_be_aborted_apart_from_its_parent(core):
    core.submit(queue.SimpleQueue(), PROMPT, SamplingParams(n=2), "p", 0, None)
    assert not core.abort("0_p")
    core.release("1_p")
    assert not any(isinstance(m, AbortRequests) for m in core.sent)


def test_releasing_the_parent_aborts_its_children(core):
    core.submit(queue.SimpleQueue(), PROMPT, SamplingParams(n=2), "p", 0, None)
    core.release("p")
    assert core.sent[-1] == AbortRequests(["0_p", "1_p"])


def test_a_failed_child_fails_the_parent_and_aborts_its_live_siblings(core):
    q = queue.SimpleQueue()
    core.submit(q, PROMPT, SamplingParams(n=3), "p", 0, None)
    core.process_outputs(out("0_p", [1], FinishReason.LENGTH))
    core.handle_frame(encode(out("1_p", [], FinishReason.ERROR, error="bad seed")))
    items = drain(q)
    assert isinstance(items[-1], RequestError) and "bad seed" in str(items[-1])
    assert core.sent[-1] == AbortRequests(["2_p"])
    core.process_outputs(out("2_p", [4]))  # late output of an aborted child: dropped
    assert q.empty()


def test_a_child_id_taken_by_a_running_request_is_refused(core):
    core.submit(queue.SimpleQueue(), PROMPT, None, "1_p", 0, None)
    with pytest.raises(ValueError, match="1_p"):
        core.submit(queue.SimpleQueue(), PROMPT, SamplingParams(n=2), "p", 0, None)
    core.submit(queue.SimpleQueue(), PROMPT, SamplingParams(n=2), "q", 0, None)
    with pytest.raises(ValueError, match="'q'"):
        core.submit(queue.SimpleQueue(), PROMPT, None, "q", 0, None)


def test_a_lost_engine_fails_the_parent_once(core):
    q = queue.SimpleQueue()
    core.submit(q, PROMPT, SamplingParams(n=3), "p", 0, None)
    assert sorted(core.fail_all(RuntimeError("gone"))) == ["0_p", "1_p", "2_p"]
    assert [type(i) for i in drain(q)] == [RuntimeError]


def _lp(*values: float) -> list[TokenLogprobs]:
    """The sampled token 7's logprobs."""
    return [TokenLogprobs([7], [v]) for v in values]


@pytest.mark.parametrize("user_logprobs", [None, 1])
def test_best_of_keeps_the_n_highest_cumulative_logprobs(user_logprobs):
    params = SamplingParams(n=2, best_of=4, logprobs=user_logprobs)
    processor = OutputProcessor(None)
    parent = processor.add_request(EngineCoreRequest("p", PROMPT, params, 0.0))
    sums = {}
    scores = [(-1.0, -2.0), (-0.5,), (-4.0,), (-0.25, -1.0)]
    for child, values in zip(parent.children, scores, strict=True):
        sums[child.request.request_id] = sum(values)
        end = EngineCoreOutput(child.request.request_id, [7] * len(values), FinishReason.LENGTH)
        end.logprobs = _lp(*values)
        finished = processor.process_outputs(EngineCoreOutputs([end])).finished
    assert finished == [parent.result] and parent.result.finished
    best = sorted(sums.values(), reverse=True)[:2]  # -0.5 (child 1), -1.25 (child 3)
    outputs = parent.result.outputs
    assert [c.cumulative_logprob for c in outputs] == best
    assert [c.index for c in outputs] == [0, 1]
    assert [len(c.token_ids) for c in outputs] == [1, 2]
    if user_logprobs is None:
        assert all(c.logprobs is None for c in outputs)
    else:
        sampled = [[e[7].logprob for e in c.logprobs] for c in outputs]
        assert sampled == [[-0.5], [-0.25, -1.0]]


def test_the_fake_engine_through_both_clients():
    params = SamplingParams(n=3, max_tokens=4, seed=1)
    with FakeEngine() as engine, EngineClient(engine.address) as client:
        result = client.generate(PROMPT, params, request_id="sync")
        assert [(c.index, c.token_ids, c.finish_reason) for c in result.outputs] == [
            (i, [5, 6, 7, 5], "length") for i in range(3)
        ]
        deltas = list(client.stream(PROMPT, params, request_id="streamed"))
        finished = [d.outputs[0].index for d in deltas if d.outputs[0].finish_reason]
        assert sorted(finished) == [0, 1, 2] and deltas[-1].finished
        assert not any(d.finished for d in deltas[:-1])
        with pytest.raises(ValueError, match="best_of"):
            next(client.stream(PROMPT, SamplingParams(n=1, best_of=2)))

        async def run_async():
            async with AsyncEngineClient(engine.address) as aclient:
                out = await aclient.generate(PROMPT, params, request_id="async")
                with pytest.raises(ValueError, match="best_of"):
                    await anext(aclient.stream(PROMPT, SamplingParams(n=2, best_of=3)))
                return out

        out = asyncio.run(run_async())
        assert [c.token_ids for c in out.outputs] == [[5, 6, 7, 5]] * 3
        ids = [r.request_id for r in engine.requests]
        assert ids == [f"{i}_{p}" for p in ("sync", "streamed", "async") for i in range(3)]
