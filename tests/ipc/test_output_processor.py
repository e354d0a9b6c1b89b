"""The InputProcessor and the OutputProcessor on their own, as LLM uses them: requests
without a queue, whose results come back from process_outputs once finished, and the engine
request ids the caller must abort. The clients' path (queues, RequestError) is
test_parallel_sampling's and test_client*'s."""

from __future__ import annotations

import pytest

from ipc.client.input_processor import InputProcessor
from ipc.client.output_processor import OutputProcessor, engine_states
from ipc.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
from ipc.sampling_params import SamplingParams
from tests.server.fake_engine import BOS, CharTokenizer

TOKENIZER = CharTokenizer()


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def step(*outputs: EngineCoreOutput):
    return EngineCoreOutputs(list(outputs))


def tracked(prompt="hi", request_id="r", **params):
    """An OutputProcessor tracking one request (no queue), and that request's handle."""
    processor = OutputProcessor(TOKENIZER)
    request, text = InputProcessor(TOKENIZER).process(prompt, SamplingParams(**params), request_id)
    return processor, processor.add_request(request, text)


def test_the_input_processor_encodes_prompts_and_bad_words():
    inputs = InputProcessor(TOKENIZER)
    request, text = inputs.process({"prompt": "hi"}, SamplingParams(bad_words=["ab"]), "r", 3)
    assert (request.request_id, request.prompt_token_ids, text) == ("r", [BOS, *ids("hi")], "hi")
    assert request.priority == 3
    assert request.sampling_params.bad_words_token_ids == [ids("ab"), ids(" ab")]
    request, text = inputs.process({"prompt_token_ids": [4, 5]}, SamplingParams(), "t")
    assert (request.prompt_token_ids, text) == ([4, 5], None)
    with pytest.raises(ValueError, match="nothing else"):
        inputs.process({"prompt": "hi", "multi_modal_data": {}}, SamplingParams(), "x")
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        InputProcessor(None).process([1], SamplingParams(stop=["x"]), "y")


def test_results_come_back_finished_without_a_queue_and_a_stop_string_is_aborted():
    processor, handle = tracked(stop=["lo"])
    first = processor.process_outputs(step(EngineCoreOutput("r", ids("he"))))
    # The last character waits: a stop string could begin there.
    assert handle.result.outputs[0].text == "h"
    assert first.finished == [] and first.reqs_to_abort == []
    last = processor.process_outputs(step(EngineCoreOutput("r", ids("llo"))))
    assert last.reqs_to_abort == ["r"]  # the engine goes on past a stop string
    assert last.finished == [handle.result]
    assert handle.result.outputs[0].text == "hel" and handle.result.prompt == "hi"
    assert not processor.has_unfinished_requests() and not processor.request_states
    late = processor.process_outputs(step(EngineCoreOutput("r", ids("x"))))
    assert late.finished == [] and late.reqs_to_abort == []


def test_children_map_to_their_parent_until_they_finish():
    processor, handle = tracked(n=2)
    children = [state.request.request_id for state in engine_states(handle)]
    assert children == ["0_r", "1_r"]
    assert all(processor.parent_of[child] is handle for child in children)
    assert not hasattr(engine_states(handle)[0], "parent")
    processed = processor.process_outputs(
        step(EngineCoreOutput("1_r", [9], FinishReason.LENGTH), EngineCoreOutput("0_r", [8]))
    )
    assert processed.finished == []
    states = engine_states(handle)
    assert [(s.result.outputs[0].token_ids, s.result.finished) for s in states] == [
        ([8], False),
        ([9], True),
    ]
    assert list(processor.parent_of) == ["0_r"]
    processed = processor.process_outputs(step(EngineCoreOutput("0_r", [7], FinishReason.STOP)))
    assert processed.finished == [handle.result]
    assert [(c.index, c.token_ids) for c in handle.result.outputs] == [(0, [8, 7]), (1, [9])]
    assert not processor.parent_of and not processor.request_states
    assert not processor.has_unfinished_requests()


def test_a_failed_child_finishes_its_parent_and_aborts_its_live_siblings():
    processor, handle = tracked(n=3)
    processor.process_outputs(step(EngineCoreOutput("2_r", [5], FinishReason.LENGTH)))
    failed = EngineCoreOutput("0_r", [], FinishReason.ERROR, error="bad grammar")
    processed = processor.process_outputs(step(failed))
    assert processed.reqs_to_abort == ["1_r"]
    assert processed.finished == [handle.result]
    result = handle.result
    assert result.finished and result.error == "bad grammar"
    reasons = [(c.index, c.finish_reason) for c in result.outputs]
    assert reasons == [(0, "error"), (1, "abort"), (2, "length")]
    assert not processor.has_unfinished_requests() and not processor.parent_of


def test_a_request_id_in_use_is_refused():
    processor, _ = tracked(n=2)
    request, _ = InputProcessor(TOKENIZER).process([1], SamplingParams(), "1_r")
    with pytest.raises(ValueError, match="'1_r' is already running"):
        processor.add_request(request)
    assert processor.abort("r") == ["0_r", "1_r"]
    processor.add_request(request)
