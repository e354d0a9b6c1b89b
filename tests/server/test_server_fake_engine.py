"""What only a scripted engine can show: the SamplingParams the server sends, and the
server's answers when the engine refuses a request, dies, or loses its HTTP client."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from ipc.sampling_params import SamplingParams
from server import build_app
from tests.server.fake_engine import BOS, FakeEngineClient


def last_request(engine) -> tuple[list[int], SamplingParams]:
    return list(engine.client.requests.values())[-1]


def test_logits_processing_fields_reach_the_engine(oai, engine):
    oai.chat.completions.create(
        model=engine.model_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        presence_penalty=0.5,
        frequency_penalty=-1.5,
        logit_bias={"7": -100, "9": 2.5},
        extra_body={"repetition_penalty": 1.2, "allowed_token_ids": [7, 9, 11]},
    )
    _, params = last_request(engine)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1.5)
    assert params.repetition_penalty == 1.2
    assert params.logit_bias == {7: -100.0, 9: 2.5}
    assert params.allowed_token_ids == [7, 9, 11]


def test_bad_words_reach_the_engine_tokenized_as_is_and_mid_text(oai, engine):
    encode = engine.tokenizer.encode
    oai.completions.create(
        model=engine.model_name, prompt="Hi", max_tokens=2, extra_body={"bad_words": ["ab"]}
    )
    _, params = last_request(engine)
    assert params.bad_words == ["ab"]
    assert params.bad_words_token_ids == [encode("ab", False), encode(" ab", False)]
    oai.chat.completions.create(
        model=engine.model_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_body={"bad_words": [" c"]},
    )
    assert last_request(engine)[1].bad_words_token_ids == [encode("c", False), encode(" c", False)]


def test_completion_fields_reach_the_engine(oai, engine):
    oai.completions.create(
        model=engine.model_name,
        prompt="Hi",
        max_tokens=8,
        temperature=0.5,
        top_p=0.9,
        seed=7,
        stop="zz",
        logprobs=2,
        extra_body={
            "top_k": 5,
            "min_p": 0.1,
            "stop_token_ids": [9],
            "ignore_eos": True,
            "min_tokens": 3,
            "skip_special_tokens": False,
        },
    )
    prompt_ids, params = last_request(engine)
    assert prompt_ids == engine.tokenizer.encode("Hi")
    assert params == SamplingParams(
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        seed=7,
        max_tokens=8,
        min_tokens=3,
        stop=["zz"],
        stop_token_ids=[9],
        ignore_eos=True,
        logprobs=2,
        skip_special_tokens=False,
    )


def test_chat_fields_and_defaults_reach_the_engine(oai, engine):
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
        }
    ]
    oai.chat.completions.create(model=engine.model_name, messages=messages, max_tokens=2)
    prompt_ids, params = last_request(engine)
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert prompt_ids == engine.tokenizer.encode(text, add_special_tokens=False)
    assert params == SamplingParams(temperature=1.0, max_tokens=2)

    oai.chat.completions.create(
        model=engine.model_name,
        messages=messages,
        logprobs=True,
        top_logprobs=4,
        max_completion_tokens=3,
        max_tokens=50,
    )
    assert last_request(engine)[1] == SamplingParams(max_tokens=3, logprobs=4)

    oai.chat.completions.create(model=engine.model_name, messages=messages, logprobs=True)
    prompt_ids, params = last_request(engine)
    assert params == SamplingParams(max_tokens=engine.max_model_len - len(prompt_ids), logprobs=0)


def test_completions_default_to_16_tokens(oai, engine):
    oai.completions.create(model=engine.model_name, prompt="Hi")
    assert last_request(engine)[1] == SamplingParams(max_tokens=16)


def test_blocking_request_whose_client_leaves_is_aborted(live_server, engine):
    body = {"model": engine.model_name, "prompt": "Go", "max_tokens": 400, "ignore_eos": True}
    headers = {"Authorization": "Bearer test-key"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live_server.url + "/v1/completions", json=body, headers=headers, timeout=0.2)
    request_id = next(reversed(engine.client.requests))
    deadline = time.monotonic() + 10
    while request_id not in engine.client.aborted:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.02)


@pytest.fixture
def dead_engine(engine):
    engine.client.alive = False
    yield engine
    engine.client.alive = True


def test_dead_engine_is_503_on_health_and_requests(oai, http, dead_engine):
    assert http.get("/health").status_code == 503
    with pytest.raises(openai.InternalServerError) as error:
        oai.completions.create(model=dead_engine.model_name, prompt="Hi")
    assert error.value.status_code == 503
    stream = {"model": dead_engine.model_name, "prompt": "Hi", "stream": True}
    assert http.post("/v1/completions", json=stream).status_code == 503
    metrics = http.get("/metrics")
    assert metrics.status_code == 200 and "splitserve:time_to_first_token_seconds" in metrics.text
    assert "splitserve:num_requests_running" not in metrics.text


def test_engine_dying_mid_stream_sends_an_error_event(http, engine):
    body = {
        "model": engine.model_name,
        "prompt": "Go",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    try:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = (line for line in response.iter_lines() if line)
            first = next(lines)
            engine.client.alive = False
            rest = list(lines)
    finally:
        engine.client.alive = True
    assert json.loads(first[6:])["object"] == "text_completion"
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][6:])["error"]
    assert error["type"] == "service_unavailable" and "not available" in error["message"]
    assert "fake engine" not in error["message"]  # the engine's own words stay in the log


def test_engine_refusal_is_400_with_its_message():
    """Without max_model_len the server cannot check lengths; the engine's refusal
    (RequestError) is the client's 400, streaming or not."""
    fake = FakeEngineClient(max_model_len=10)
    app = build_app(fake, fake.tokenizer, "fake-model")

    async def post(body: dict) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/completions", json=body)

    for stream in (False, True):
        body = {"prompt": "a prompt too long", "max_tokens": 2, "stream": stream}
        response = asyncio.run(post(body))
        assert response.status_code == 400
        assert "exceeds max_model_len 10" in response.json()["error"]["message"]
    ok = asyncio.run(post({"prompt": "short", "max_tokens": 2}))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_generation_config_defaults_apply_under_the_request():
    fake = FakeEngineClient()
    defaults = {"temperature": 0.2, "top_p": 0.9}
    app = build_app(fake, fake.tokenizer, "fake-model", sampling_defaults=defaults)

    async def post(body: dict) -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200

    asyncio.run(post({"prompt": "Hi", "max_tokens": 2}))
    _, params = list(fake.requests.values())[-1]
    assert (params.temperature, params.top_p) == (0.2, 0.9)
    asyncio.run(post({"prompt": "Hi", "max_tokens": 2, "temperature": 1.0}))
    _, params = list(fake.requests.values())[-1]
    assert (params.temperature, params.top_p) == (1.0, 0.9)


def _prompt_entry(tokenizer, token_id: int, p: int, k: int) -> dict:
    """What the fake engine's prompt logprobs for prompt token p look like on the wire."""
    entry = {str(token_id): {"logprob": -p / 8, "rank": p, "decoded_token": None}}
    entry.update({str(BOS + i): {"logprob": -float(i), "rank": i} for i in range(1, k + 1)})
    for t, value in entry.items():
        value["decoded_token"] = tokenizer.decode([int(t)], skip_special_tokens=False)
    return entry


def test_prompt_logprobs_in_vllm_shape(http, engine):
    tokenizer = engine.tokenizer
    prompt_ids = tokenizer.encode("Hi!")
    body = {"model": engine.model_name, "prompt": "Hi!", "max_tokens": 2, "prompt_logprobs": 2}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    expected = [None] + [_prompt_entry(tokenizer, t, p, 2) for p, t in enumerate(prompt_ids[1:], 1)]
    assert choice["prompt_logprobs"] == expected
    assert choice["logprobs"] is None
    assert last_request(engine)[1].prompt_logprobs == 2
    chat = {
        "model": engine.model_name,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "prompt_logprobs": 0,
    }
    answer = http.post("/v1/chat/completions", json=chat).json()
    chat_ids = last_request(engine)[0]
    assert answer["prompt_logprobs"][0] is None
    assert answer["prompt_logprobs"][1:] == [
        _prompt_entry(tokenizer, t, p, 0) for p, t in enumerate(chat_ids[1:], 1)
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_puts_the_prompt_tokens_first(oai, engine, stream):
    tokenizer = engine.tokenizer
    prompt_ids = tokenizer.encode("Hi!")
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in prompt_ids]
    answer = oai.completions.create(
        model=engine.model_name, prompt="Hi!", max_tokens=2, echo=True, logprobs=1, stream=stream
    )
    choice = next(iter(answer)).choices[0] if stream else answer.choices[0]
    assert choice.text.startswith("Hi!")
    logprobs = choice.logprobs
    n = len(prompt_ids)
    assert logprobs.tokens[:n] == texts
    assert logprobs.token_logprobs[:n] == [None] + [-p / 8 for p in range(1, n)]
    assert logprobs.top_logprobs[0] is None
    eos = tokenizer.decode([BOS + 1], skip_special_tokens=False)
    assert logprobs.top_logprobs[1] == {texts[1]: -1 / 8, eos: -1.0}
    lengths = [len(t) for t in logprobs.tokens]
    assert logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    assert logprobs.token_logprobs[n] == -0.25  # then the completion's tokens
    assert last_request(engine)[1].prompt_logprobs == 1
