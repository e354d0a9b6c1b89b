"""Stop conditions, checked token by token, and requests refused at add time."""

import pytest
from stand_in_executor import collect, make_engine, make_request, run_to_completion

from ipc.messages import EngineCoreRequest, FinishReason, ModelRunnerOutput, TokenLogprobs
from ipc.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("script", "sampling", "expected", "reason"),
    [
        ([5, 2, 9], {}, [5, 2], "stop"),  # EOS (from the config) is kept in the output
        ([5, 3, 9], {}, [5, 3], "stop"),  # a second EOS id of the config
        ([5, 2, 9], {"ignore_eos": True, "max_tokens": 3}, [5, 2, 9], "length"),
        ([5, 9, 1], {"stop_token_ids": [9]}, [5, 9], "stop"),
        ([5, 9, 1], {"stop_token_ids": [9], "ignore_eos": True}, [5, 9], "stop"),
        ([5, 6, 7, 8, 9], {"max_tokens": 4}, [5, 6, 7, 8], "length"),
        ([5, 6, 2], {"max_tokens": 3}, [5, 6, 2], "stop"),  # a stop on the last allowed token
        # min_tokens=2: stops count only once two tokens precede them.
        ([2, 9, 2, 5], {"min_tokens": 2, "stop_token_ids": [9]}, [2, 9, 2], "stop"),
        ([9, 2, 5, 9], {"min_tokens": 2, "stop_token_ids": [9]}, [9, 2, 5, 9], "stop"),
    ],
)
def test_stop_conditions(script, sampling, expected, reason):
    engine, _ = make_engine(script={"r": script}, eos_token_ids=[2, 3])
    engine.add_request(make_request("r", 5, **sampling))
    assert run_to_completion(engine) == {"r": [expected, reason]}
    assert engine.kv_cache_manager.block_pool.get_num_free_blocks() == 63


def test_max_model_len_caps_a_request_without_max_tokens():
    engine, _ = make_engine(max_model_len=64)
    engine.add_request(make_request("r", 60, max_tokens=None))
    tokens, reason = run_to_completion(engine)["r"]
    assert (len(tokens), reason) == (4, "length")


def test_tokens_of_a_partial_prefill_step_produce_no_output():
    engine, executor = make_engine(max_num_batched_tokens=8)
    engine.add_request(make_request("r", 20, max_tokens=2))
    outputs = [engine.step().outputs for _ in range(4)]
    assert [so.num_scheduled_tokens for so in executor.outputs] == [
        {"r": 8},
        {"r": 8},
        {"r": 4},
        {"r": 1},
    ]
    assert [[o.new_token_ids for o in out] for out in outputs] == [[], [], [[7]], [[7]]]
    assert outputs[3][0].finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize(
    ("prompt", "sampling", "message"),
    [
        ([], {}, "empty"),
        (64, {"max_tokens": 1}, "max_model_len is 64"),
        (100, {}, "max_model_len is 64"),
        (60, {"max_tokens": 5}, "plus max_tokens (5) exceeds max_model_len (64)"),
        (60, {"max_tokens": None, "min_tokens": 5}, "exceeds max_model_len"),
        ([1, 50000], {}, "[0, 50000)"),
        ([1, -1], {}, "[0, 50000)"),
        ([2**64 - 1], {}, "[0, 50000)"),
        # Stop ids index the vocabulary in the worker's min_tokens mask: one past its end
        # once took the whole cluster down.
        ([1, 2], {"stop_token_ids": [50000], "min_tokens": 1}, "stop_token_ids must be in"),
        ([1, 2], {"seed": 2**64}, "seed must be a 64-bit integer"),
        ([1, 2], {"logit_bias": {3: 1.0, 50000: 2.0}}, "logit_bias token ids must be in"),
        ([1, 2], {"allowed_token_ids": [3, 50000]}, "allowed_token_ids must be in"),
        ([1, 2], {"bad_words_token_ids": [[3], [4, 50000]]}, "bad_words_token_ids must be in"),
    ],
)
def test_requests_that_can_never_run_are_finished_with_an_error(prompt, sampling, message):
    engine, executor = make_engine(vocab_size=50000)
    if isinstance(prompt, int):
        prompt = list(range(prompt))
    engine.add_request(EngineCoreRequest("bad", prompt, SamplingParams(**sampling), 0.0))
    engine.add_request(make_request("good", [1, 2, 3], max_tokens=1))
    outputs = engine.step()
    bad = outputs.outputs[0]
    assert bad.request_id == "bad" and message in bad.error
    results: dict[str, list] = {}
    collect(outputs, results)
    assert results == {"bad": [[], "error"], "good": [[7], "length"]}
    assert all("bad" not in so.num_scheduled_tokens for so in executor.outputs)
    assert all("bad" not in so.finished_req_ids for so in executor.outputs)


def _scheduled(*request_ids: str):
    """A scheduler that has scheduled the first step of these 4-token requests."""
    engine, _ = make_engine()
    for request_id in request_ids:
        engine.add_request(make_request(request_id, 4, max_tokens=8))
    return engine.scheduler, engine.scheduler.schedule()


def test_a_request_the_workers_cannot_take_fails_alone():
    scheduler, scheduler_output = _scheduled("bad", "good")
    runner_output = ModelRunnerOutput(
        scheduler_output.step_id, ["good"], [[5]], failed_requests={"bad": "no room"}
    )
    bad, good = scheduler.update_from_output(scheduler_output, runner_output).outputs
    assert (bad.request_id, bad.finish_reason, bad.error) == ("bad", FinishReason.ERROR, "no room")
    assert (good.request_id, good.new_token_ids, good.finish_reason) == ("good", [5], None)
    assert [r.request_id for r in scheduler.running] == ["good"]
    assert scheduler.schedule().finished_req_ids == ["bad"]


def test_the_longest_valid_request_runs():
    engine, _ = make_engine(max_model_len=64)
    engine.add_request(make_request("r", 63, max_tokens=1))
    assert run_to_completion(engine) == {"r": [[7], "length"]}


def test_an_error_output_is_returned_without_a_model_step():
    engine, executor = make_engine()
    engine.add_request(make_request("r", [], max_tokens=1))
    assert engine.has_unfinished_requests()
    results: dict[str, list] = {}
    collect(engine.step(), results)
    assert results == {"r": [[], "error"]}
    assert executor.outputs == [] and not engine.has_unfinished_requests()


def test_a_request_id_in_use_is_refused_and_the_first_request_is_untouched():
    engine, _ = make_engine()
    engine.add_request(make_request("r", 4, max_tokens=2))
    engine.add_request(make_request("r", 4, max_tokens=2))
    outputs = engine.step().outputs
    assert "already in use" in outputs[0].error
    assert run_to_completion(engine) == {"r": [[7], "length"]}


def test_tokens_after_a_stop_in_one_output_are_dropped():
    scheduler, scheduler_output = _scheduled("r")
    runner_output = ModelRunnerOutput(scheduler_output.step_id, ["r"], [[5, 2, 9]])
    (output,) = scheduler.update_from_output(scheduler_output, runner_output).outputs
    assert (output.new_token_ids, output.finish_reason) == ([5, 2], FinishReason.STOP)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.get_stats().num_generation_tokens == 2


def test_logprobs_travel_with_their_tokens():
    scheduler, scheduler_output = _scheduled("a", "b")
    per_token = [TokenLogprobs([t, 1], [-0.5, -1.5]) for t in (5, 2, 9)]
    runner_output = ModelRunnerOutput(
        scheduler_output.step_id, ["a", "b"], [[5, 2, 9], [6]], [per_token, None]
    )
    a, b = scheduler.update_from_output(scheduler_output, runner_output).outputs
    assert a.logprobs == per_token[:2]  # trimmed at the stop, as the tokens are
    assert b.logprobs is None
