"""RequestState's stop handling, as vLLM's: the stop string or stop token that ended a
request is its stop_reason (None for EOS); it stays in the text only with
include_stop_str_in_output, streamed or not. Logprobs come out in vLLM's shape."""

from __future__ import annotations

import pytest

from ipc.client.request_state import RequestState
from ipc.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, TokenLogprobs
from ipc.outputs import Logprob
from ipc.sampling_params import SamplingParams
from tests.server.fake_engine import EOS, CharTokenizer

TOKENIZER = CharTokenizer()


def run(tokens: list[int], last_reason: FinishReason | None, **params) -> tuple[str, list]:
    """Feed `tokens` one per output; the streamed text and the final delta."""
    request = EngineCoreRequest("r", [7, 8], SamplingParams(**params), 0.0)
    state = RequestState(request, TOKENIZER, None)
    texts, delta = [], None
    for i, token in enumerate(tokens):
        reason = last_reason if i == len(tokens) - 1 else None
        delta = state.apply(EngineCoreOutput("r", [token], reason))
        texts.append(delta.outputs[0].text)
        if delta.finished:
            break
    assert "".join(texts) == state.result.outputs[0].text
    return state.result.outputs[0].text, delta.outputs[0]


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(("include", "want"), [(False, "hello "), (True, "hello wor")])
def test_a_stop_string_is_the_stop_reason(include, want):
    text, last = run(
        ids("hello world"), None, stop=["xyz", "wor"], include_stop_str_in_output=include
    )
    assert text == want
    assert (last.finish_reason, last.stop_reason) == ("stop", "wor")


def test_the_earliest_stop_string_wins():
    _, last = run(ids("hello world"), None, stop=["world", "lo"])
    assert last.stop_reason == "lo"


@pytest.mark.parametrize(("include", "want"), [(False, "ab"), (True, "abc")])
def test_a_stop_token_is_the_stop_reason_and_text_only_when_included(include, want):
    stop = ids("c")[0]
    params = {"stop_token_ids": [stop], "include_stop_str_in_output": include}
    text, last = run(ids("abc"), FinishReason.STOP, **params)
    assert text == want and (last.finish_reason, last.stop_reason) == ("stop", stop)


def test_eos_and_length_have_no_stop_reason():
    text, last = run(ids("ab") + [EOS], FinishReason.STOP, skip_special_tokens=False)
    assert text == "ab" and (last.finish_reason, last.stop_reason) == ("stop", None)
    _, last = run(ids("ab"), FinishReason.LENGTH, stop_token_ids=[ids("b")[0]])
    assert (last.finish_reason, last.stop_reason) == ("length", None)


def test_a_stop_string_in_the_last_output_beats_length():
    request = EngineCoreRequest("r", [7], SamplingParams(stop=["ll"]), 0.0)
    state = RequestState(request, TOKENIZER, None)
    last = state.apply(EngineCoreOutput("r", ids("hello"), FinishReason.LENGTH)).outputs[0]
    assert (last.text, last.finish_reason, last.stop_reason) == ("he", "stop", "ll")
    assert not state.stopped_by_string  # the engine has finished it already


def test_prompt_logprobs_add_up_over_deltas_with_none_first():
    request = EngineCoreRequest("r", [7, 8, 9, 10], SamplingParams(prompt_logprobs=1), 0.0)
    state = RequestState(request, TOKENIZER, None)
    chunks = [
        [TokenLogprobs([8, 3], [-1.0, -0.5], 2)],
        [TokenLogprobs([9, 3], [-2.0, -0.5], 3), TokenLogprobs([10, 10], [-0.1, -0.1], 1)],
    ]
    first = state.apply(EngineCoreOutput("r", [], prompt_logprobs=chunks[0]))
    second = state.apply(EngineCoreOutput("r", [5], prompt_logprobs=chunks[1]))
    last = state.apply(EngineCoreOutput("r", [6], FinishReason.LENGTH))

    def text(token_id: int) -> str:
        return TOKENIZER.decode([token_id], skip_special_tokens=False)

    # vLLM's shape: the prompt's token first with its rank, then the top-k ranked 1..k.
    by_token = [
        {8: Logprob(-1.0, 2, text(8)), 3: Logprob(-0.5, 1, text(3))},
        {9: Logprob(-2.0, 3, text(9)), 3: Logprob(-0.5, 1, text(3))},
        {10: Logprob(-0.1, 1, text(10))},  # in its own top-1: once
    ]
    assert first.prompt_logprobs == [None, by_token[0]]
    assert second.prompt_logprobs == by_token[1:] and last.prompt_logprobs is None
    assert state.result.prompt_logprobs == [None, *by_token]
    assert list(state.result.prompt_logprobs[1]) == [8, 3]  # the prompt's token first
    plain = RequestState(EngineCoreRequest("p", [7], SamplingParams(), 0.0), TOKENIZER, None)
    assert plain.apply(EngineCoreOutput("p", [5], FinishReason.LENGTH)).prompt_logprobs is None
