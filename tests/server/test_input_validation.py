"""Inputs that used to slip past validation (numbers too large for the wire, non-finite
floats, lone surrogates, unknown roles, token ids outside the vocabulary) are 400s naming
their field, for any engine behind the `engine` fixture."""

from __future__ import annotations

import pytest

from tests.server.api_helpers import assert_400_naming

pytestmark = pytest.mark.engines("fake")  # each test marked otherwise names its engines

HUGE = 2**64
JSON = {"content-type": "application/json"}

COMPLETION_FIELDS = [
    ({"seed": HUGE}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"top_k": HUGE}, "top_k"),
    ({"n": HUGE}, "n"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"min_tokens": -HUGE}, "min_tokens"),
    ({"logprobs": HUGE}, "logprobs"),
    ({"stop_token_ids": [5, HUGE]}, "stop_token_ids"),
    ({"prompt": [5, HUGE]}, "prompt"),
    ({"prompt": [[HUGE]]}, "prompt"),
]


@pytest.mark.engines("fake", "zmq")
@pytest.mark.parametrize(("extra", "param"), COMPLETION_FIELDS)
def test_integers_beyond_int64_are_400_naming_the_field(http, engine, extra, param):
    body = {"model": engine.model_name, "prompt": "Hi", "max_tokens": 2, **extra}
    assert_400_naming(http.post("/v1/completions", json=body), param)


@pytest.mark.engines("fake", "zmq")
@pytest.mark.parametrize("field", ["top_logprobs", "max_completion_tokens", "seed"])
def test_chat_integers_beyond_int64_are_400_naming_the_field(http, engine, field):
    body = {"model": engine.model_name, "messages": [{"role": "user", "content": "Hi"}]}
    body |= {"logprobs": True, field: HUGE}
    assert_400_naming(http.post("/v1/chat/completions", json=body), field)


@pytest.mark.engines("fake", "zmq")
@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"prompt": "Hi", "temperature": 1e309}', "temperature"),
        (b'{"prompt": "Hi", "top_p": NaN}', "top_p"),
        (b'{"prompt": "Hi", "min_p": -Infinity}', "min_p"),
    ],
)
def test_non_finite_floats_are_400_naming_the_field(http, raw, param):
    assert_400_naming(http.post("/v1/completions", content=raw, headers=JSON), param)


@pytest.mark.engines("fake", "zmq")
@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", '{"prompt": ["\\udfff"]}', "prompt"),
        ("/v1/completions", '{"prompt": "Hi", "stop": "\\ud800"}', "stop"),
        ("/v1/completions", '{"prompt": "Hi", "model": "\\ud800"}', "model"),
        ("/v1/completions", '{"prompt": "Hi", "cache_salt": "\\ud800"}', "cache_salt"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "\\ud83d"}]}',
            "messages",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
            "messages",
        ),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(http, path, raw, param):
    assert_400_naming(http.post(path, content=raw.encode(), headers=JSON), param)


def test_invalid_utf8_bodies_are_400(http):
    raw = b'{"prompt": "\xff\xfe"}'
    response = http.post("/v1/completions", content=raw, headers=JSON)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.engines("fake", "zmq")
@pytest.mark.parametrize("role", ["", "robot", "System", None])
def test_unknown_roles_are_400_naming_messages(http, engine, role):
    body = {"model": engine.model_name, "messages": [{"role": role, "content": "Hi"}]}
    assert_400_naming(http.post("/v1/chat/completions", json=body), "messages")


@pytest.mark.engines("fake", "zmq")
@pytest.mark.parametrize("role", ["system", "user", "assistant", "tool", "developer"])
def test_known_roles_are_served(http, engine, role):
    body = {
        "model": engine.model_name,
        "messages": [{"role": role, "content": "Hi"}, {"role": "user", "content": "Go"}],
        "max_tokens": 2,
    }
    assert http.post("/v1/chat/completions", json=body).status_code == 200


@pytest.mark.engines("fake", "zmq")
@pytest.mark.parametrize("field", ["prompt", "stop_token_ids"])
def test_token_ids_outside_the_vocabulary_are_400_naming_the_field(http, engine, field):
    assert engine.vocab_size is not None
    body = {"model": engine.model_name, "prompt": [5, 6], "max_tokens": 2}
    body[field] = [5, engine.vocab_size]
    assert_400_naming(http.post("/v1/completions", json=body), field)
    body[field] = [5, engine.vocab_size - 1]
    assert http.post("/v1/completions", json=body).status_code == 200


@pytest.mark.parametrize(
    ("field", "bad", "good"),
    [
        ("allowed_token_ids", lambda v: [5, v], lambda v: [5, v - 1]),
        ("logit_bias", lambda v: {"5": 1.0, str(v): 2}, lambda v: {str(v - 1): -2}),
        ("logit_bias", lambda v: {"-1": 1.0}, lambda v: {"0": 100}),
        ("logit_bias", lambda v: {" 5": 1.0}, lambda v: {"5": 1.0}),
        ("logit_bias", lambda v: {str(HUGE): 1.0}, lambda v: {}),
    ],
)
def test_logit_processing_token_ids_must_be_in_the_vocabulary(http, engine, field, bad, good):
    body = {"model": engine.model_name, "prompt": [5, 6], "max_tokens": 2}
    body[field] = bad(engine.vocab_size)
    assert_400_naming(http.post("/v1/completions", json=body), field)
    body[field] = good(engine.vocab_size)
    assert http.post("/v1/completions", json=body).status_code == 200


@pytest.mark.engines("fake", "zmq")
@pytest.mark.parametrize("salt", ["", "x" * 257, 7])
def test_cache_salt_is_a_short_non_empty_string(http, engine, salt):
    body = {"model": engine.model_name, "prompt": "Hi", "max_tokens": 2, "cache_salt": salt}
    assert_400_naming(http.post("/v1/completions", json=body), "cache_salt")


@pytest.mark.engines("zmq")
def test_refused_requests_leave_nothing_registered_in_the_engine_client(http, engine):
    """Every refusal happens before the engine client registers the request (a request
    that failed to encode used to stay registered, and answer a plain-text 500)."""
    for extra, _ in COMPLETION_FIELDS:
        body = {"model": engine.model_name, "prompt": "Hi", "max_tokens": 2, **extra}
        assert http.post("/v1/completions", json=body).status_code == 400
    body = {"model": engine.model_name, "prompt": [5, engine.vocab_size], "max_tokens": 2}
    assert http.post("/v1/completions", json=body).status_code == 400
    assert not engine.client._core.output_processor.has_unfinished_requests()
