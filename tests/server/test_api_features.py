"""vLLM's additions users reach for, through the official `openai` client where it shows
them: stop_reason, include_stop_str_in_output, echo, priority, X-Request-Id, /tokenize,
/detokenize, /version and vLLM's metric names. Expected answers come from the engine
client itself, so these tests hold for any engine behind the `engine` fixture."""

from __future__ import annotations

import json

import pytest

from tests.server.api_helpers import MESSAGES, chat_ids, engine_answer, read_metrics

pytestmark = pytest.mark.engines("fake")  # each test marked otherwise names its engines

VLLM_METRICS = [
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prompt_tokens_total",
    "generation_tokens_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "num_preemptions_total",
    "time_to_first_token_seconds_count",
    "inter_token_latency_seconds_count",
    "time_per_output_token_seconds_count",
    "e2e_request_latency_seconds_count",
    "request_prompt_tokens_count",
    "request_generation_tokens_count",
    "request_max_num_generation_tokens_count",
    "request_prefill_kv_computed_tokens_count",
    "request_params_n_count",
    "request_params_max_tokens_count",
    "request_time_per_output_token_seconds_count",
    "request_decode_time_seconds_count",
    "request_queue_time_seconds_count",
    "request_prefill_time_seconds_count",
    "request_inference_time_seconds_count",
    "request_num_preemptions_count",
    "iteration_tokens_total_count",
    "prompt_tokens_cached_total",
]


def stream_text(chunks) -> tuple[str, object]:
    """The streamed text and the last choice."""
    chunks = [c for c in chunks if c.choices]
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0]


@pytest.mark.engines("fake", "zmq", "cluster")
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_give_stop_reason_and_may_stay_in_the_text(
    oai, live_server, engine, text_prompt, include
):
    ids = engine.tokenizer.encode(text_prompt)
    full = engine_answer(live_server, engine, ids, max_tokens=20, ignore_eos=True).text
    stop = full[6:9]
    want = full[: full.index(stop) + len(stop) * include]
    fields = {
        "model": engine.model_name,
        "prompt": text_prompt,
        "max_tokens": 20,
        "temperature": 0,
        "stop": ["never-seen-stop", stop],
        "extra_body": {"ignore_eos": True, "include_stop_str_in_output": include},
    }

    got = oai.completions.create(**fields).choices[0]
    text, last = stream_text(oai.completions.create(**fields, stream=True))

    assert got.text == text == want
    assert got.finish_reason == last.finish_reason == "stop"
    assert got.stop_reason == last.stop_reason == stop


@pytest.mark.engines("fake", "cluster")
def test_chat_choices_carry_stop_reason(oai, engine):
    got = oai.chat.completions.create(
        model=engine.model_name, messages=MESSAGES, max_tokens=3, temperature=0
    )
    assert got.choices[0].stop_reason is None  # length, or EOS


@pytest.mark.engines("fake", "cluster")
def test_a_stop_token_is_the_stop_reason_and_not_text(oai, live_server, engine, text_prompt):
    ids = engine.tokenizer.encode(text_prompt)
    full = engine_answer(live_server, engine, ids, max_tokens=8, ignore_eos=True)
    stop_id = full.token_ids[3]
    want = engine_answer(
        live_server, engine, ids, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id]
    )
    for include in (False, True):
        got = oai.completions.create(
            model=engine.model_name,
            prompt=ids,
            max_tokens=8,
            temperature=0,
            extra_body={
                "ignore_eos": True,
                "stop_token_ids": [stop_id],
                "include_stop_str_in_output": include,
            },
        ).choices[0]
        assert (got.finish_reason, got.stop_reason) == ("stop", stop_id)
        stop_text = engine.tokenizer.decode(want.token_ids, skip_special_tokens=True)
        assert got.text == (stop_text if include else want.text)
        assert stop_text.startswith(want.text)


@pytest.mark.engines("fake", "zmq", "cluster")
def test_length_has_no_stop_reason(oai, engine):
    got = oai.completions.create(
        model=engine.model_name, prompt=[5, 6], max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert (got.choices[0].finish_reason, got.choices[0].stop_reason) == ("length", None)


@pytest.mark.engines("fake", "zmq", "cluster")
def test_echo_puts_the_prompt_before_the_completion(oai, live_server, engine):
    prompt = "Once upon"
    ids = engine.tokenizer.encode(prompt)
    want = engine_answer(live_server, engine, ids, max_tokens=4).text
    fields = {"model": engine.model_name, "max_tokens": 4, "temperature": 0, "echo": True}

    assert oai.completions.create(prompt=prompt, **fields).choices[0].text == prompt + want
    assert stream_text(oai.completions.create(prompt=prompt, stream=True, **fields))[0] == (
        prompt + want
    )
    decoded = engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert oai.completions.create(prompt=ids, **fields).choices[0].text == decoded + want


@pytest.mark.engines("fake", "cluster")
def test_priority_reaches_the_engine(oai, engine):
    got = oai.completions.create(
        model=engine.model_name, prompt="Hi", max_tokens=2, extra_body={"priority": -3}
    )
    assert got.choices[0].finish_reason in ("stop", "length")


@pytest.mark.engines("fake", "zmq", "cluster")
def test_x_request_id_is_echoed_and_names_the_response(oai, http, engine):
    body = {"model": engine.model_name, "prompt": "Hi", "max_tokens": 2}
    raw = oai.completions.with_raw_response.create(
        **body, extra_headers={"X-Request-Id": "trace-42"}
    )
    assert raw.headers["x-request-id"] == "trace-42" and raw.parse().id == "cmpl-trace-42"

    chat = {"model": engine.model_name, "messages": MESSAGES, "max_tokens": 2}
    response = http.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "c-1"})
    assert response.headers["x-request-id"] == "c-1" and response.json()["id"] == "chatcmpl-c-1"
    response = http.post("/v1/completions", json=body)
    assert response.json()["id"] == "cmpl-" + response.headers["x-request-id"]
    response = http.post("/v1/completions", json={**body, "request_id": "mine"})
    assert response.json()["id"] == "cmpl-mine"


@pytest.mark.engines("fake", "zmq", "cluster")
def test_a_request_id_already_running_is_400(http, engine):
    body = {"model": engine.model_name, "prompt": [5, 6], "max_tokens": 200, "stream": True}
    body["ignore_eos"] = True
    headers = {"X-Request-Id": "twice"}
    with http.stream("POST", "/v1/completions", json=body, headers=headers) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # kept: a collected iterator closes the connection
        json.loads(next(line for line in lines if line)[6:])
        second = http.post("/v1/completions", json=body, headers=headers)
        assert second.status_code == 400 and "already running" in second.text


@pytest.mark.engines("fake", "zmq", "cluster")
def test_tokenize_and_detokenize_in_vllm_shapes(http, engine):
    ids = engine.tokenizer.encode("Hello world")
    got = http.post("/tokenize", json={"model": engine.model_name, "prompt": "Hello world"})
    assert got.json() == {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
    plain = engine.tokenizer.encode("Hello world", add_special_tokens=False)
    got = http.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False})
    assert got.json()["tokens"] == plain
    got = http.post("/tokenize", json={"messages": MESSAGES})
    assert got.json()["tokens"] == chat_ids(engine, MESSAGES)
    without = engine.tokenizer.encode_chat(MESSAGES, add_generation_prompt=False)
    got = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})
    assert got.json()["tokens"] == without
    assert http.post("/tokenize", json={}).status_code == 400

    got = http.post("/detokenize", json={"model": engine.model_name, "tokens": ids})
    assert got.json() == {"prompt": engine.tokenizer.decode(ids, skip_special_tokens=False)}
    assert http.post("/detokenize", json={"tokens": [-1]}).json()["error"]["param"] == "tokens"


@pytest.mark.engines("fake", "cluster")
def test_version(http):
    version = http.get("/version").json()["version"]
    assert isinstance(version, str) and version


@pytest.mark.engines("fake", "cluster")
def test_metrics_have_vllm_names_with_the_model_name(oai, http, engine):
    oai.completions.create(
        model=engine.model_name, prompt=[5, 6], max_tokens=3, extra_body={"ignore_eos": True}
    )
    metrics = read_metrics(http)
    label = (("engine", "0"), ("model_name", engine.model_name))
    for name in VLLM_METRICS:
        assert (f"splitserve:{name}", label) in metrics, name
    success = (
        "splitserve:request_success_total",
        (label[0], ("finished_reason", "length"), label[1]),
    )
    assert metrics[success] >= 1


@pytest.mark.engines("fake", "zmq", "cluster")
def test_continuous_usage_stats_put_the_usage_in_every_chunk(http, engine):
    body = {
        "model": engine.model_name,
        "prompt": [5, 6],
        "max_tokens": 3,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    response = http.post("/v1/completions", json=body)
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    chunks = [json.loads(event) for event in events[:-1]]
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 3
    assert all(chunk["usage"]["prompt_tokens"] == 2 for chunk in chunks)


@pytest.mark.engines("fake", "zmq", "cluster")
def test_truncate_prompt_tokens_keeps_the_last_ones(oai, http, live_server, engine):
    prompt = "The quick brown fox jumps"
    ids = engine.tokenizer.encode(prompt)
    want = engine_answer(live_server, engine, ids[-3:], max_tokens=4).text
    fields = {"model": engine.model_name, "max_tokens": 4, "temperature": 0}
    got = oai.completions.create(prompt=prompt, **fields, extra_body={"truncate_prompt_tokens": 3})
    assert got.choices[0].text == want and got.usage.prompt_tokens == 3

    keep = engine.max_model_len - 4
    too_long = "word " * engine.max_model_len * 2
    got = oai.completions.create(
        prompt=too_long, **fields, extra_body={"truncate_prompt_tokens": keep}
    )
    assert got.usage.prompt_tokens == keep
    chat = {"model": engine.model_name, "max_tokens": 2, "truncate_prompt_tokens": keep}
    chat["messages"] = [{"role": "user", "content": too_long}]
    assert http.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens"] == keep
    for bad in (0, -2, engine.max_model_len + 1):
        body = {"model": engine.model_name, "prompt": prompt, "truncate_prompt_tokens": bad}
        error = http.post("/v1/completions", json=body).json()["error"]
        assert error["param"] == "truncate_prompt_tokens"
