"""Every request field is honoured or refused: a field this server does not implement is a
400 naming it (unless its value asks for nothing), and so is a field it does not know."""

from __future__ import annotations

import openai
import pytest

from tests.server.api_helpers import assert_400_naming

pytestmark = pytest.mark.engines("fake")  # each test marked otherwise names its engines

USER = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# (field, a value this server cannot honour)
REFUSED_BOTH = [
    ("use_beam_search", True),
    ("length_penalty", 0.5),
    ("structural_tag", "{}"),
    ("guided_decoding_backend", "xgrammar"),
    ("guided_whitespace_pattern", " "),
    ("logits_processors", ["p"]),
    ("spaces_between_special_tokens", False),
    ("vllm_xargs", {"a": 1}),
]
REFUSED_COMPLETIONS = [("suffix", "end"), ("prompt_embeds", "AAAA")]
REFUSED_CHAT = [
    ("functions", [TOOL["function"]]),
    ("function_call", {"name": "f"}),
    ("add_special_tokens", True),
    ("chat_template", "{{ messages }}"),
    ("chat_template_kwargs", {"enable_thinking": False}),
    ("documents", [{"text": "d"}]),
    ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("mm_processor_kwargs", {"a": 1}),
    ("media_io_kwargs", {"a": 1}),
    ("reasoning_effort", "low"),
    ("include_reasoning", False),
    ("verbosity", "low"),
    ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {}),
    ("store", True),
    ("service_tier", "flex"),
]
# No-op values: accepted, and answered as without them.
NO_OPS_BOTH = {
    "n": 1,
    "best_of": 1,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "prompt_logprobs": None,
    "response_format": {"type": "text"},
    "bad_words": [],
    "spaces_between_special_tokens": True,
    "return_token_ids": False,
    "user": "end-user-7",
    "stream_options": None,
}
NO_OPS_COMPLETIONS = {"suffix": None, "echo": False}
NO_OPS_CHAT = {
    "tools": [],
    "tool_choice": "none",
    "parallel_tool_calls": False,
    "echo": False,
    "store": False,
    "service_tier": "auto",
    "modalities": ["text"],
    "metadata": {"k": "v"},
    "safety_identifier": "s",
    "prompt_cache_key": "k",
    "add_generation_prompt": True,
}


def completion(engine, **fields) -> dict:
    return {"model": engine.model_name, "prompt": "Hi", "max_tokens": 2, **fields}


def chat(engine, **fields) -> dict:
    return {"model": engine.model_name, "messages": USER, "max_tokens": 2, **fields}


def assert_refused(response, param: str) -> None:
    assert_400_naming(response, param)
    assert "not supported" in response.json()["error"]["message"]


@pytest.mark.parametrize(("field", "value"), REFUSED_BOTH + REFUSED_COMPLETIONS)
def test_unsupported_completion_fields_are_400_naming_them(http, engine, field, value):
    response = http.post("/v1/completions", json=completion(engine, **{field: value}))
    assert_refused(response, field)
    assert f"`{field}`" in response.json()["error"]["message"]


@pytest.mark.parametrize(("field", "value"), REFUSED_BOTH + REFUSED_CHAT)
def test_unsupported_chat_fields_are_400_naming_them(http, engine, field, value):
    assert_refused(http.post("/v1/chat/completions", json=chat(engine, **{field: value})), field)


@pytest.mark.engines("fake", "zmq", "cluster")
def test_no_op_values_are_accepted(http, engine):
    body = completion(engine, **NO_OPS_BOTH, **NO_OPS_COMPLETIONS)
    assert http.post("/v1/completions", json=body).status_code == 200
    body = chat(engine, **NO_OPS_BOTH, **NO_OPS_CHAT)
    assert http.post("/v1/chat/completions", json=body).status_code == 200


@pytest.mark.engines("fake", "zmq", "cluster")
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_fields_are_400_naming_them(http, engine, path):
    body = (completion if "chat" not in path else chat)(engine, frobnicate=1)
    response = http.post(path, json=body)
    assert_refused(response, "frobnicate")
    assert response.json()["error"]["message"] == "`frobnicate` is not supported by this server"
    body = chat(engine, stream=True, stream_options={"include_usage": True, "x": 1})
    assert_refused(http.post("/v1/chat/completions", json=body), "stream_options")


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": "Hi", "extra": 1},
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi", "extra": 1}]},
    ],
)
def test_unsupported_message_fields_are_400_naming_messages(http, engine, message):
    body = chat(engine, messages=[message])
    assert_refused(http.post("/v1/chat/completions", json=body), "messages")


def test_a_message_name_reaches_the_template(http, engine):
    body = chat(engine, messages=[{"role": "user", "content": "Hi", "name": "ann"}])
    assert http.post("/v1/chat/completions", json=body).status_code == 200


@pytest.mark.engines("fake", "cluster")
def test_the_openai_client_sees_refusals_as_bad_requests(oai, engine):
    with pytest.raises(openai.BadRequestError, match="`functions` is not supported") as caught:
        oai.chat.completions.create(
            model=engine.model_name, messages=USER, max_tokens=2, functions=[TOOL["function"]]
        )
    assert caught.value.body["param"] == "functions"
    with pytest.raises(openai.BadRequestError, match="`guided_decoding_backend`"):
        oai.completions.create(
            model=engine.model_name,
            prompt="Hi",
            max_tokens=2,
            extra_body={"guided_decoding_backend": "xgrammar"},
        )


def test_prompt_logprobs_with_stream_are_refused_as_in_vllm(http, engine):
    body = completion(engine, prompt_logprobs=1, stream=True)
    assert_400_naming(http.post("/v1/completions", json=body), "prompt_logprobs")
    body = chat(engine, prompt_logprobs=0, stream=True)
    assert_400_naming(http.post("/v1/chat/completions", json=body), "prompt_logprobs")
    body = completion(engine, prompt_logprobs=21)
    assert_400_naming(http.post("/v1/completions", json=body), "prompt_logprobs")
