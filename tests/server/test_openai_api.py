"""The HTTP API through the official `openai` client (and raw HTTP where the wire format
itself is the point). Expected answers come from the engine client called directly, so
these tests hold for any engine behind the `engine` fixture (see conftest.py)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.api_helpers import (
    MESSAGES,
    chat_ids,
    engine_answer,
    first_chunk_id,
    long_completion,
    read_metrics,
    wait_for_aborts,
)

pytestmark = pytest.mark.engines("fake")  # each test marked otherwise names its engines


@pytest.mark.engines("fake", "zmq", "cluster")
def test_completion_text_and_usage_match_the_engine(oai, live_server, engine):
    prompt = "Once upon a time"
    ids = engine.tokenizer.encode(prompt)
    want = engine_answer(live_server, engine, ids, max_tokens=12)

    got = oai.completions.create(
        model=engine.model_name, prompt=prompt, max_tokens=12, temperature=0
    )

    assert got.object == "text_completion" and got.model == engine.model_name
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), len(want.token_ids))
    assert got.usage.total_tokens == len(ids) + len(want.token_ids)


@pytest.mark.engines("fake", "zmq", "cluster")
def test_completion_of_token_ids_defaults_to_16_tokens(oai, live_server, engine):
    ids = engine.tokenizer.encode("The sky is")
    want = engine_answer(live_server, engine, ids, max_tokens=16, ignore_eos=True)

    got = oai.completions.create(
        model=engine.model_name, prompt=ids, temperature=0, extra_body={"ignore_eos": True}
    )

    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == 16 and got.choices[0].finish_reason == "length"


@pytest.mark.engines("fake", "zmq", "cluster")
def test_completion_stream_with_usage(oai, live_server, engine):
    prompt = "Hello"
    ids = engine.tokenizer.encode(prompt)
    want = engine_answer(live_server, engine, ids, max_tokens=10)

    chunks = list(
        oai.completions.create(
            model=engine.model_name,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )

    *deltas, last = chunks
    assert "".join(c.choices[0].text for c in deltas) == want.text
    assert [c.choices[0].finish_reason for c in deltas if c.choices[0].finish_reason] == [
        want.finish_reason
    ]
    assert last.choices == [] and last.usage.completion_tokens == len(want.token_ids)
    assert last.usage.prompt_tokens == len(ids)


@pytest.mark.engines("fake", "zmq", "cluster")
def test_chat_text_and_usage_match_the_engine(oai, live_server, engine):
    ids = chat_ids(engine, MESSAGES)
    want = engine_answer(live_server, engine, ids, max_tokens=9)

    got = oai.chat.completions.create(
        model=engine.model_name, messages=MESSAGES, max_completion_tokens=9, temperature=0
    )

    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), len(want.token_ids))


@pytest.mark.engines("fake", "zmq", "cluster")
def test_chat_stream(oai, live_server, engine):
    want = engine_answer(live_server, engine, chat_ids(engine, MESSAGES), max_tokens=7)

    chunks = list(
        oai.chat.completions.create(
            model=engine.model_name,
            messages=MESSAGES,
            max_tokens=7,
            temperature=0,
            stream=True,
        )
    )

    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def _longest_chat_that_fits(engine) -> tuple[list[dict], int]:
    """Messages whose prompt leaves a few tokens of room, and that room."""

    def length(words: int) -> int:
        return len(chat_ids(engine, [{"role": "user", "content": "go " * words}]))

    low, high = 0, engine.max_model_len
    while low < high:  # the most words whose prompt is shorter than max_model_len
        mid = (low + high + 1) // 2
        low, high = (mid, high) if length(mid) < engine.max_model_len else (low, mid - 1)
    return [{"role": "user", "content": "go " * low}], engine.max_model_len - length(low)


@pytest.mark.engines("fake", "zmq")
def test_chat_without_max_tokens_may_fill_the_context(oai, engine):
    messages, room = _longest_chat_that_fits(engine)

    got = oai.chat.completions.create(
        model=engine.model_name, messages=messages, extra_body={"ignore_eos": True}
    )

    assert got.usage.completion_tokens == room and got.choices[0].finish_reason == "length"


@pytest.mark.engines("fake", "zmq", "cluster")
def test_stop_strings_cut_the_text(oai, live_server, engine, text_prompt):
    ids = engine.tokenizer.encode(text_prompt)
    full = engine_answer(live_server, engine, ids, max_tokens=20, ignore_eos=True).text
    stop = full[6:9]

    for stop_field in (stop, [stop, "never-seen-stop"]):
        got = oai.completions.create(
            model=engine.model_name,
            prompt=text_prompt,
            max_tokens=20,
            temperature=0,
            stop=stop_field,
            extra_body={"ignore_eos": True},
        )
        assert got.choices[0].text == full[: full.index(stop)]
        assert got.choices[0].finish_reason == "stop"


@pytest.mark.engines("fake", "cluster")
def test_completion_logprobs_in_openai_shape(oai, live_server, engine):
    ids = engine.tokenizer.encode("Numbers:")
    want = engine_answer(live_server, engine, ids, max_tokens=5, logprobs=2, ignore_eos=True)

    got = oai.completions.create(
        model=engine.model_name,
        prompt=ids,
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )

    def token(t: int) -> str:
        return engine.tokenizer.decode([t], skip_special_tokens=False)

    logprobs = got.choices[0].logprobs
    assert logprobs.tokens == [token(t) for t in want.token_ids]
    sampled = [entry[t].logprob for t, entry in zip(want.token_ids, want.logprobs, strict=True)]
    assert logprobs.token_logprobs == pytest.approx(sampled)
    for top, entry in zip(logprobs.top_logprobs, want.logprobs, strict=True):
        assert top == pytest.approx({token(t): lp.logprob for t, lp in entry.items()})
    lengths = [len(t) for t in logprobs.tokens]
    assert logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]


@pytest.mark.engines("fake", "cluster")
def test_chat_logprobs_in_openai_shape(oai, live_server, engine):
    want = engine_answer(
        live_server, engine, chat_ids(engine, MESSAGES), max_tokens=4, logprobs=3, ignore_eos=True
    )

    got = oai.chat.completions.create(
        model=engine.model_name,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )

    content = got.choices[0].logprobs.content
    sampled = [entry[t] for t, entry in zip(want.token_ids, want.logprobs, strict=True)]
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in sampled])
    for c, token_id, entry in zip(content, want.token_ids, want.logprobs, strict=True):
        assert c.token == engine.tokenizer.decode([token_id], skip_special_tokens=False)
        assert c.bytes == list(c.token.encode())
        top = sorted(entry.values(), key=lambda lp: lp.rank)[:3]  # the 3 most likely
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([lp.logprob for lp in top])
        assert [t.token for t in c.top_logprobs] == [lp.decoded_token for lp in top]


@pytest.mark.engines("fake", "zmq", "cluster")
def test_sse_wire_format_ends_with_done(http, engine):
    body = {"model": engine.model_name, "prompt": "Hi", "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


@pytest.mark.engines("fake", "zmq", "cluster")
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 129}, "n"),
        ({"n": 0}, "n"),
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"top_p": "high"}, "top_p"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"stop": 7}, "stop"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"max_tokens": 10**6}, "max_tokens"),
    ],
)
def test_invalid_parameters_are_400_in_openai_shape(http, engine, extra, param):
    body = {"model": engine.model_name, "prompt": "Hi", **extra}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"]


def test_invalid_parameters_raise_bad_request_in_the_openai_client(oai, engine):
    with pytest.raises(openai.BadRequestError, match=r"n must be in \[1, 128\]"):
        oai.completions.create(model=engine.model_name, prompt="Hi", n=1000)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.chat.completions.create(model=engine.model_name, messages=MESSAGES, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        oai.chat.completions.create(model=engine.model_name, messages=MESSAGES, top_logprobs=2)


@pytest.mark.parametrize("top_logprobs", [21, -1])
def test_chat_top_logprobs_out_of_range_is_400_naming_it(http, engine, top_logprobs):
    body = {"model": engine.model_name, "messages": MESSAGES, "logprobs": True}
    response = http.post("/v1/chat/completions", json=body | {"top_logprobs": top_logprobs})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"


@pytest.mark.engines("fake", "zmq")
def test_malformed_bodies_are_400(http):
    assert http.post("/v1/completions", content=b"{not json").status_code == 400
    assert http.post("/v1/completions", json={"max_tokens": 3}).json()["error"]["param"] == "prompt"
    assert http.post("/v1/chat/completions", json={"messages": []}).status_code == 400


@pytest.mark.engines("fake", "zmq", "cluster")
def test_prompt_longer_than_the_context_is_400_naming_the_limit(oai, engine):
    ids = engine.tokenizer.encode("x") * engine.max_model_len
    with pytest.raises(
        openai.BadRequestError, match=f"maximum context length is {engine.max_model_len} tokens"
    ) as error:
        oai.completions.create(model=engine.model_name, prompt=ids)
    assert error.value.code == "context_length_exceeded"


@pytest.mark.engines("fake", "zmq", "cluster")
def test_wrong_api_key_is_401(live_server, engine, http):
    bad = openai.OpenAI(base_url=live_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=engine.model_name, prompt="Hi")
    response = http.get("/v1/models", headers={"Authorization": ""})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.engines("fake", "zmq", "cluster")
def test_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError, match="no-such-model") as error:
        oai.completions.create(model="no-such-model", prompt="Hi")
    assert error.value.code == "model_not_found"


@pytest.mark.engines("fake", "zmq")
def test_models_lists_the_served_model(oai, engine):
    assert [m.id for m in oai.models.list()] == [engine.model_name]


@pytest.mark.engines("fake", "zmq", "cluster")
def test_health_is_200_while_the_engine_answers(http):
    assert http.get("/health").status_code == 200


@pytest.mark.engines("fake", "cluster")
def test_metrics_parse_and_move_after_a_request(oai, http, engine):
    before = read_metrics(http)
    prompt_ids = engine.tokenizer.encode("Count")

    list(
        oai.completions.create(
            model=engine.model_name,
            prompt=prompt_ids,
            max_tokens=5,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    after = read_metrics(http)

    def moved(name: str, **labels) -> float:
        labels.update(model_name=engine.model_name, engine="0")
        key = (f"splitserve:{name}", tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert moved("request_success_total", finished_reason="length") == 1
    assert moved("time_to_first_token_seconds_count") == 1
    assert 1 <= moved("inter_token_latency_seconds_count") <= 4
    assert moved("e2e_request_latency_seconds_count") == 1
    assert moved("generation_tokens_total") >= 5
    assert moved("prompt_tokens_total") >= len(prompt_ids)
    for gauge in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_hit_rate",
        "num_preemptions_total",
    ):
        labels = (("engine", "0"), ("model_name", engine.model_name))
        assert (f"splitserve:{gauge}", labels) in after


@pytest.mark.engines("fake", "zmq")
def test_disconnect_mid_stream_aborts_the_request(http, engine):
    wait_for_aborts(engine, first_chunk_id(http, long_completion(engine, "Go", stream=True)))
