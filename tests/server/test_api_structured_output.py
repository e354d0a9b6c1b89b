"""Structured output over HTTP with the official openai client, against a real cluster
(launch.py, tiny random Llama; SmolLM2 in the slow test): `response_format`, vLLM's
`guided_*` and `structured_outputs`, and tool_choice "required" or named, which is
structured output too. Outputs are judged by jsonschema, re.fullmatch and
membership; malformed specs and two structured fields are 400s naming the field.

A random model would repeat JSON's free whitespace forever: the json requests here bias
whitespace down (logit_bias applies after the grammar's mask) or disable it."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from ipc.client import AsyncEngineClient
from ipc.tokenizer import Tokenizer
from server import build_app
from tests.cluster.helpers import launch_cluster
from tests.models.tiny import make_tiny_checkpoint
from tests.server.api_helpers import assert_400_naming
from tests.server.harness import EngineHarness, LiveServer, smollm2_server

MAX_MODEL_LEN = 1024  # room for the tool-call tests' tool descriptions
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 99},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
NO_WHITESPACE = {str(b): -100.0 for b in b" \t\n\r"}
USER = [{"role": "user", "content": "abc"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = tmp_path_factory.mktemp("structured-cluster")
    path = make_tiny_checkpoint(
        folder, "llama", name="llama", max_position_embeddings=MAX_MODEL_LEN
    )
    with launch_cluster(folder, path, "--tp", "1", "--max-model-len", str(MAX_MODEL_LEN)) as c:
        yield c


@pytest.fixture(scope="module")
def engine(cluster) -> EngineHarness:
    tokenizer = Tokenizer.from_pretrained(cluster.model)
    client = AsyncEngineClient(cluster.address, tokenizer=tokenizer)
    return EngineHarness(client, tokenizer, "llama", MAX_MODEL_LEN, lambda _: True, 288)


def chat(oai: openai.OpenAI, **kw) -> str:
    kw = {"model": "llama", "messages": USER, "max_tokens": 100, "temperature": 0, **kw}
    choice = oai.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    return choice.message.content


def complete(oai: openai.OpenAI, prompt: str = "xyz", **kw) -> str:
    kw = {"model": "llama", "prompt": prompt, "max_tokens": 60, "temperature": 0, **kw}
    choice = oai.completions.create(**kw).choices[0]
    assert choice.finish_reason == "stop", choice.text
    return choice.text


def test_response_format_json_schema_validates(oai):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
    }
    for prompt in ("abc", "Where?", "{"):
        messages = [{"role": "user", "content": prompt}]
        text = chat(
            oai, messages=messages, response_format=response_format, logit_bias=NO_WHITESPACE
        )
        jsonschema.validate(json.loads(text), SCHEMA)


def test_response_format_json_object(oai):
    text = chat(oai, response_format={"type": "json_object"}, logit_bias={"125": 100.0})
    assert json.loads(text) == {}  # "}" biased up closes the object at once


def test_guided_json_as_object_or_text_and_structured_outputs_json(oai):
    for extra in (
        {"guided_json": SCHEMA, "logit_bias": NO_WHITESPACE},
        {"guided_json": json.dumps(SCHEMA), "logit_bias": NO_WHITESPACE},
        {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
    ):
        jsonschema.validate(json.loads(complete(oai, extra_body=extra)), SCHEMA)


def test_guided_regex_choice_and_grammar(oai):
    regex = r"[a-c]{2,4}-\d{2}"
    assert re.fullmatch(regex, complete(oai, extra_body={"guided_regex": regex}))
    choices = ["alpha", "beta", "gamma"]
    assert complete(oai, extra_body={"guided_choice": choices}) in choices
    grammar = 'root ::= "go " dir\ndir ::= "north" | "south"'
    assert complete(oai, extra_body={"guided_grammar": grammar}) in ("go north", "go south")
    assert chat(oai, extra_body={"structured_outputs": {"choice": choices}}) in choices
    assert re.fullmatch(regex, chat(oai, extra_body={"structured_outputs": {"regex": regex}}))


def test_a_streamed_structured_output_is_whole(oai):
    choices = ["alpha", "beta", "gamma"]
    stream = oai.completions.create(
        model="llama",
        prompt="abc",
        max_tokens=20,
        stream=True,
        extra_body={"guided_choice": choices},
    )
    assert "".join(chunk.choices[0].text for chunk in stream) in choices


BAD = [
    (
        "response_format",
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        "nope",
    ),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ("response_format", {"type": "structural_tag"}, "response_format"),
    ("guided_json", '{"type": "object", "properties": 3}', "properties"),
    ("guided_json", "{not json", "not valid JSON"),
    ("guided_regex", "a(b", "unclosed group"),
    ("guided_choice", [], "guided_choice"),
    ("guided_grammar", "root ::= missing", "missing"),
    ("structured_outputs", {"json": {"type": "nope"}}, "nope"),
    ("structured_outputs", {"regex": "a", "choice": ["a"]}, "exactly one"),
    ("structured_outputs", {"grammar": "start: ("}, "grammar"),
]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize(("field", "value", "problem"), BAD)
def test_malformed_specs_are_400_naming_the_field(http, endpoint, field, value, problem):
    if endpoint == "chat":
        url, body = "/v1/chat/completions", {"model": "llama", "messages": USER}
    else:
        url, body = "/v1/completions", {"model": "llama", "prompt": "abc"}
    response = http.post(url, json={**body, "max_tokens": 5, field: value})
    assert_400_naming(response, field)
    assert problem in response.json()["error"]["message"]


def test_two_structured_fields_are_400_naming_the_second(http, oai):
    body = {"model": "llama", "prompt": "abc", "guided_regex": "a+", "guided_choice": ["a"]}
    response = http.post("/v1/completions", json=body)
    assert_400_naming(response, "guided_choice")
    assert "`guided_regex` and `guided_choice`" in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(
            model="llama",
            messages=USER,
            response_format={"type": "json_object"},
            extra_body={"guided_json": SCHEMA},
        )
    assert caught.value.body["param"] == "guided_json"


def test_text_response_format_and_null_fields_ask_for_nothing(oai):
    def text(**extra) -> str:
        body = {"ignore_eos": True, **extra}
        kw = {"model": "llama", "prompt": "xyz", "max_tokens": 5, "temperature": 0}
        return oai.completions.create(**kw, extra_body=body).choices[0].text

    plain = text()
    assert len(plain) > 0
    nulls = {"guided_json": None, "guided_regex": None, "structured_outputs": None}
    assert text(**nulls) == plain
    assert text(response_format={"type": "text"}) == plain


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


def small_tool(name: str, key: str, values: list) -> dict:
    """A tool short enough to describe within the tiny model's context."""
    schema = {
        "type": "object",
        "properties": {key: {"enum": values}},
        "required": [key],
        "additionalProperties": False,  # else a random model adds properties until max_tokens
    }
    return {"type": "function", "function": {"name": name, "parameters": schema}}


TIME_TOOL = small_tool("time", "zone", ["CET", "UTC"])


def check_calls(calls, tools) -> None:
    """Each call names one of `tools` and its arguments validate against its schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tool_choice_required_and_named_always_give_calls_that_validate(oai):
    tools = [small_tool("weather", "city", ["Rome", "Oslo"]), TIME_TOOL]
    kw = {"model": "llama", "messages": USER, "max_tokens": 120, "tools": tools}
    for temperature in (0, 1):
        choice = oai.chat.completions.create(
            **kw, tool_choice="required", parallel_tool_calls=False, temperature=temperature
        ).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, tools)
    named = {"type": "function", "function": {"name": "time"}}
    choice = oai.chat.completions.create(**kw, tool_choice=named, temperature=1).choices[0]
    assert choice.finish_reason == "stop"
    assert [c.function.name for c in choice.message.tool_calls] == ["time"]
    check_calls(choice.message.tool_calls, tools)
    chunks = list(oai.chat.completions.create(**kw, tool_choice=named, stream=True, n=2))
    for index in (0, 1):
        parts = [
            tc
            for c in chunks
            for choice in c.choices
            if choice.index == index
            for tc in choice.delta.tool_calls or ()
        ]
        assert parts[0].function.name == "time"
        arguments = "".join(p.function.arguments or "" for p in parts)
        jsonschema.validate(json.loads(arguments), TIME_TOOL["function"]["parameters"])


def test_auto_tool_choice_parses_the_calls_a_model_writes(cluster):
    """A regex makes the tiny model write a hermes tool call; the server started with
    --enable-auto-tool-choice --tool-call-parser hermes reads it, whole and streamed."""
    tokenizer = Tokenizer.from_pretrained(cluster.model)
    client = AsyncEngineClient(cluster.address, tokenizer=tokenizer)
    options = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    server = LiveServer(build_app(client, tokenizer, "llama", **options), client)
    regex = r'Sure\.<tool_call>\{"name": "time", "arguments": \{"zone": "(CET|UTC)"\}\}</tool_call>'
    kw = {
        "model": "llama",
        "messages": USER,
        "max_tokens": 120,
        "tools": [TIME_TOOL],
        "extra_body": {"guided_regex": regex},
    }
    try:
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        choice = oai.chat.completions.create(**kw).choices[0]
        chunks = list(oai.chat.completions.create(**kw, stream=True))
    finally:
        server.stop()
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    check_calls(choice.message.tool_calls, [TIME_TOOL])
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Sure."
    (call,) = [tc for d in deltas for tc in d.tool_calls or ()]
    assert call.function.name == "time"
    jsonschema.validate(json.loads(call.function.arguments), TIME_TOOL["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_tool_schema_llguidance_cannot_compile_is_400_naming_tools(http):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    body = {"model": "llama", "messages": USER, "tools": [bad], "tool_choice": "required"}
    assert_400_naming(http.post("/v1/chat/completions", json=body), "tools")


@pytest.mark.slow
def test_smollm2_answers_a_json_schema_and_a_required_tool_call(tmp_path):
    with smollm2_server(tmp_path, max_model_len=1024) as oai:
        call = oai.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the weather in Rome this week?"}],
            max_tokens=100,
            temperature=0,
            tools=[WEATHER_TOOL],
            tool_choice="required",
        ).choices[0]
        answer = oai.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Which city is the capital of France?"}],
            max_tokens=200,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
            },
        ).choices[0]
    assert answer.finish_reason == "stop"
    jsonschema.validate(json.loads(answer.message.content), SCHEMA)
    assert call.finish_reason == "tool_calls"
    check_calls(call.message.tool_calls, [WEATHER_TOOL])
