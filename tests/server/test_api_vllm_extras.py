"""vLLM's batched completions (`prompt` as a list of prompts), `return_token_ids`,
`return_tokens_as_token_ids`, and chat's `continue_final_message` and `echo`. Expected
answers come from the engine client itself, so these tests hold for any engine behind the
`engine` fixture (the echo test: any whose reply does not depend on the prompt)."""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import pytest

from server.inputs import MAX_BATCHED_SEQUENCES
from tests.server.api_helpers import (
    assert_400_naming,
    chat_ids,
    engine_answer,
    first_chunk_id,
    long_completion,
    wait_for_aborts,
)

pytestmark = pytest.mark.engines("fake")  # each test marked otherwise names its engines

PROMPTS = ["Once upon a time", "The sky is", "Hi"]
USER = {"role": "user", "content": "Hi"}


def greedy(engine, max_tokens: int, **fields) -> dict:
    """A greedy request body for `max_tokens` tokens, EOS ignored."""
    common = {"model": engine.model_name, "temperature": 0, "ignore_eos": True}
    return {**common, "max_tokens": max_tokens, **fields}


def events(response) -> list[dict]:
    """The JSON chunks of a server-sent event stream, [DONE] left out."""
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def joined(chunks: list[dict], field: str) -> dict[int, object]:
    """Each choice's `field` joined over the chunks, by choice index."""
    out = defaultdict(lambda: "" if field == "text" else [])
    for chunk in chunks:
        for choice in chunk["choices"]:
            out[choice["index"]] += choice[field]
    return dict(out)


@pytest.mark.engines("fake", "zmq")
@pytest.mark.parametrize("as_ids", [False, True])
def test_a_batch_of_prompts_answers_each_in_turn(http, live_server, engine, as_ids):
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    want = [engine_answer(live_server, engine, i, max_tokens=6, ignore_eos=True) for i in ids]
    body = {
        "model": engine.model_name,
        "prompt": ids if as_ids else PROMPTS,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }

    got = http.post("/v1/completions", json=body).json()
    chunks = events(http.post("/v1/completions", json=body | {"stream": True}))

    assert [c["index"] for c in got["choices"]] == list(range(len(PROMPTS)))
    assert [c["text"] for c in got["choices"]] == [w.text for w in want]
    assert joined(chunks, "text") == {c["index"]: c["text"] for c in got["choices"]}
    assert len({chunk["id"] for chunk in chunks} | {got["id"]}) == 2  # one id per response
    assert got["usage"] == {
        "prompt_tokens": sum(map(len, ids)),
        "completion_tokens": len(PROMPTS) * 6,
        "total_tokens": sum(map(len, ids)) + len(PROMPTS) * 6,
    }


@pytest.mark.engines("fake", "zmq")
def test_a_streamed_batch_ends_with_the_usage_of_all_its_prompts(http, engine):
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    body = {
        "model": engine.model_name,
        "prompt": PROMPTS,
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = events(http.post("/v1/completions", json=body))

    *choice_chunks, last = chunks
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == sum(map(len, ids))
    assert last["usage"]["completion_tokens"] == 4 * len(PROMPTS)
    # Continuous usage is the chunk's own prompt and choice, as in vLLM.
    for chunk in choice_chunks:
        index = chunk["choices"][0]["index"]
        assert chunk["usage"]["prompt_tokens"] == len(ids[index])
    finals = [c for c in choice_chunks if c["choices"][0]["finish_reason"] is not None]
    assert sorted(c["usage"]["completion_tokens"] for c in finals) == [4] * len(PROMPTS)


@pytest.mark.engines("fake", "zmq")
def test_a_batch_echoes_each_prompt_before_its_choices(http, engine):
    body = {"model": engine.model_name, "prompt": PROMPTS, "max_tokens": 2, "echo": True}
    for stream in (False, True):
        response = http.post("/v1/completions", json=body | {"stream": stream})
        texts = joined(events(response), "text") if stream else response.json()["choices"]
        if not stream:
            texts = {c["index"]: c["text"] for c in texts}
        assert [texts[i].startswith(p) for i, p in enumerate(PROMPTS)] == [True] * len(PROMPTS)


@pytest.mark.engines("fake", "zmq")
@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"prompt": [[5, 6], []]}, "a prompt of the batch is empty"),
        ({"prompt": ["Hi", "word " * 10_000]}, "a prompt of the batch is too long"),
        ({"prompt": [[5]] * (MAX_BATCHED_SEQUENCES + 1)}, "more sequences than a request runs"),
        ({"prompt": [[5]] * 33, "n": 128}, "33 prompts of 128 choices: more sequences too"),
    ],
)
def test_a_batch_with_one_bad_prompt_is_refused_whole(http, engine, extra, why):
    before = (
        dict(engine.client._core.output_processor.requests)
        if hasattr(engine.client, "_core")
        else None
    )
    body = {"model": engine.model_name, "max_tokens": 2, **extra}
    assert_400_naming(http.post("/v1/completions", json=body), "prompt")
    if before is not None:
        assert engine.client._core.output_processor.requests == before, why


@pytest.mark.engines("fake", "zmq")
def test_disconnecting_from_a_streamed_batch_aborts_each_prompt(http, engine):
    response_id = first_chunk_id(http, long_completion(engine, ["Go", "On"], stream=True))
    wait_for_aborts(engine, f"{response_id}-0", f"{response_id}-1")


def test_disconnecting_from_a_whole_batch_aborts_each_prompt(http, engine):
    body = long_completion(engine, ["Go", "On"], stream=False)
    headers = {"X-Request-Id": "left-early"}
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, headers=headers, timeout=0.5)
    wait_for_aborts(engine, "cmpl-left-early-0", "cmpl-left-early-1")


@pytest.mark.engines("fake", "zmq")
@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids_gives_the_prompt_and_choice_token_ids(http, live_server, engine, stream):
    ids = engine.tokenizer.encode("Once upon a time")
    want = engine_answer(live_server, engine, ids, max_tokens=5, ignore_eos=True)
    body = greedy(engine, 5, prompt="Once upon a time", return_token_ids=True, stream=stream)
    response = http.post("/v1/completions", json=body)
    if stream:
        choices = [chunk["choices"][0] for chunk in events(response)]
        assert [c["prompt_token_ids"] for c in choices] == [ids] + [None] * (len(choices) - 1)
        assert joined(events(response), "token_ids") == {0: want.token_ids}
    else:
        choice = response.json()["choices"][0]
        assert choice["prompt_token_ids"] == ids and choice["token_ids"] == want.token_ids


@pytest.mark.engines("fake", "zmq")
@pytest.mark.parametrize("stream", [False, True])
def test_chat_return_token_ids_puts_the_prompt_ids_at_the_top(http, live_server, engine, stream):
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt_ids = chat_ids(engine, messages)
    want = engine_answer(live_server, engine, prompt_ids, max_tokens=4, ignore_eos=True)
    body = greedy(engine, 4, messages=messages, return_token_ids=True, stream=stream)
    response = http.post("/v1/chat/completions", json=body)
    if stream:
        first, *rest = events(response)
        assert first["prompt_token_ids"] == prompt_ids
        assert joined(rest, "token_ids") == {0: want.token_ids}
    else:
        got = response.json()
        assert got["prompt_token_ids"] == prompt_ids
        assert got["choices"][0]["token_ids"] == want.token_ids


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(http, live_server, engine):
    ids = engine.tokenizer.encode("The sky is")
    want = engine_answer(live_server, engine, ids, max_tokens=3, ignore_eos=True, logprobs=1)
    common = {"model": engine.model_name, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    flag = {"return_tokens_as_token_ids": True}
    body = common | flag | {"prompt": ids, "logprobs": 1}
    logprobs = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in want.token_ids]
    for top, entry in zip(logprobs["top_logprobs"], want.logprobs, strict=True):
        assert set(top) == {f"token_id:{t}" for t in entry}

    messages = [{"role": "user", "content": "Name a colour."}]
    want = engine_answer(
        live_server, engine, chat_ids(engine, messages), max_tokens=3, ignore_eos=True, logprobs=1
    )
    body = common | flag | {"messages": messages, "logprobs": True, "top_logprobs": 1}
    content = http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]
    assert [c["token"] for c in content["content"]] == [f"token_id:{t}" for t in want.token_ids]
    assert content["content"][0]["bytes"] == list(f"token_id:{want.token_ids[0]}".encode())


@pytest.mark.engines("fake", "zmq")
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_without_stream_are_400(http, engine, path):
    body = {"model": engine.model_name, "max_tokens": 2, "prompt": "Hi"}
    if "chat" in path:
        body = {"model": engine.model_name, "max_tokens": 2, "messages": [USER]}
    body["stream_options"] = {"include_usage": True}
    assert_400_naming(http.post(path, json=body), "stream_options")


STARTED = [USER, {"role": "assistant", "content": "Well, the"}]


@pytest.mark.engines("fake", "zmq")
@pytest.mark.parametrize("stream", [False, True])
def test_continue_final_message_lets_the_model_go_on_with_it(http, live_server, engine, stream):
    prompt_ids = engine.tokenizer.encode_chat(STARTED, False, continue_final_message=True)
    want = engine_answer(live_server, engine, prompt_ids, max_tokens=5, ignore_eos=True)
    body = {
        "model": engine.model_name,
        "messages": STARTED,
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "return_token_ids": True,
        "stream": stream,
    }
    response = http.post("/v1/chat/completions", json=body)
    if stream:
        chunks = events(response)
        assert chunks[0]["prompt_token_ids"] == prompt_ids
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    else:
        assert response.json()["prompt_token_ids"] == prompt_ids
        text = response.json()["choices"][0]["message"]["content"]
    assert text == want.text

    tokenize = {"messages": STARTED, "add_generation_prompt": False}
    tokenized = http.post("/tokenize", json=tokenize | {"continue_final_message": True})
    assert tokenized.json()["tokens"] == prompt_ids
    del body["add_generation_prompt"]  # true by default: the two exclude each other
    assert_400_naming(http.post("/v1/chat/completions", json=body), "continue_final_message")


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_puts_an_assistant_final_message_first(http, engine, stream):
    base = {"model": engine.model_name, "max_tokens": 3, "temperature": 0, "stream": stream}
    base |= {"n": 1, "echo": True, "add_generation_prompt": False}

    def contents(messages) -> list[str]:
        response = http.post("/v1/chat/completions", json=base | {"messages": messages})
        if not stream:
            return [response.json()["choices"][0]["message"]["content"]]
        return [c["choices"][0]["delta"].get("content", "") for c in events(response)]

    echoed, plain = contents(STARTED), contents([USER])
    if stream:  # the echo is its own chunk, after the role's
        assert echoed[:2] == ["", "Well, the"] and echoed[2:] == plain[1:]
    else:
        assert echoed == ["Well, the" + plain[0]]
