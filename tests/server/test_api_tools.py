"""Tool calls over HTTP with the official openai client, on a scripted engine whose reply
is a tool call in each format: what the prompt shows the model, what the client gets whole
and streamed, and the 400s."""

import json

import openai
import pytest
import tokenizers

from ipc.tokenizer import Tokenizer
from server import build_app
from server.protocol import ToolDefinition
from server.tools import listed_tools, template_inputs
from tests.server.fake_engine import FakeEngineClient
from tests.server.harness import LiveServer

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TOOLS = [{"type": "function", "function": WEATHER}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
HERMES_REPLY = (
    'I will check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>"
)


@pytest.fixture(scope="module")
def serve():
    servers = []

    def start(reply: str, **options) -> tuple[FakeEngineClient, openai.OpenAI]:
        engine = FakeEngineClient(reply=reply, token_delay=0)
        server = LiveServer(build_app(engine, engine.tokenizer, "m", **options), engine)
        servers.append(server)
        return engine, openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    yield start
    for server in servers:
        server.stop()


AUTO = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}


def prompt_text(engine: FakeEngineClient) -> str:
    (prompt, _), *_ = reversed(engine.requests.values())
    return engine.tokenizer.decode(prompt)


def test_auto_tool_call_whole_and_streamed(serve):
    engine, client = serve(HERMES_REPLY, **AUTO)
    reply = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # The fake's template has no tools section: the tools came in a system message.
    prompt = prompt_text(engine)
    assert prompt.startswith("<s>[system] # Tools") and json.dumps(WEATHER) in prompt
    assert engine.requests[reply.id][1].structured_outputs is None

    chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    parts = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert content == "I will check."
    assert parts[0].id.startswith("chatcmpl-tool-") and parts[0].function.name == "get_weather"
    arguments = "".join(p.function.arguments or "" for p in parts)
    assert json.loads(arguments) == {"city": "Paris"}
    assert {p.index for p in parts} == {0}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_without_a_call_is_content(serve):
    _, client = serve("It is sunny <in> Paris.", **AUTO)
    reply = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    assert reply.choices[0].message.content == "It is sunny <in> Paris."
    assert not reply.choices[0].message.tool_calls and reply.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "It is sunny <in> Paris."


def test_llama3_json_parser(serve):
    reply_text = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    _, client = serve(reply_text, enable_auto_tool_choice=True, tool_call_parser="llama3_json")
    reply = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    (call,) = reply.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    assert reply.choices[0].message.content is None


def test_required_and_named_choices_ask_for_structured_output(serve):
    engine, client = serve('[{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    reply = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = reply.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Rome"}
    schema = json.loads(engine.requests[reply.id][1].structured_outputs.json)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    item = schema["items"]["anyOf"][0]["properties"]
    assert item["name"]["enum"] == ["get_weather"] and item["parameters"] == WEATHER["parameters"]

    engine, client = serve('{"city": "Rome"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=named)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.tool_calls[0].function.arguments == '{"city": "Rome"}'
    assert json.loads(engine.requests[reply.id][1].structured_outputs.json) == WEATHER["parameters"]
    chunks = list(
        client.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, tool_choice=named, stream=True
        )
    )
    parts = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert parts[0].function.name == "get_weather" and parts[0].id
    assert "".join(p.function.arguments for p in parts) == '{"city": "Rome"}'


def test_tool_choice_none_shows_tools_and_parses_nothing(serve):
    engine, client = serve(HERMES_REPLY, **AUTO)
    reply = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none")
    assert reply.choices[0].message.content == HERMES_REPLY
    assert not reply.choices[0].message.tool_calls
    assert json.dumps(WEATHER) in prompt_text(engine)


def test_history_with_calls_and_results(serve):
    engine, client = serve("It is 21 C in Paris.", **AUTO)
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    ]
    reply = client.chat.completions.create(model="m", messages=history, tools=TOOLS)
    assert reply.choices[0].message.content == "It is 21 C in Paris."
    prompt = prompt_text(engine)
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert f"[assistant] <tool_call>\n{call}\n</tool_call>" in prompt
    assert '[tool] <tool_response>\n{"celsius": 21}\n</tool_response>' in prompt


@pytest.mark.parametrize(
    ("body", "options", "param"),
    [
        ({"tools": TOOLS}, {}, "tool_choice"),  # auto without --enable-auto-tool-choice
        ({"tool_choice": "required"}, {}, "tool_choice"),  # no tools
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            {},
            "tool_choice",
        ),  # fmt: skip
        ({"tools": TOOLS + TOOLS, "tool_choice": "required"}, {}, "tools"),
        (
            {"tools": [{"type": "function", "function": {**WEATHER, "strict": True}}]},
            AUTO,
            "tools[0].function.strict",
        ),  # fmt: skip
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, AUTO, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, AUTO, "tool_choice"),
        ({"functions": [WEATHER]}, AUTO, "functions"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            AUTO,
            "tool_choice",
        ),  # fmt: skip
    ],
)
def test_refusals_name_the_field(serve, body, options, param):
    _, client = serve("x", **options)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=ASK, **body)
    assert refused.value.body["param"].startswith(param)


def test_a_template_with_a_tools_section_gets_the_tools():
    template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[{{ c.function.name }}({{ c.function.arguments.city }})]"
        "{% endfor %}|{% endfor %}"
    )
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer = Tokenizer(backend, {}, template)
    assert tokenizer.chat_template_takes_tools
    assert not Tokenizer(backend, {}, "{{ messages[0].content }}").chat_template_takes_tools
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                             "arguments": {"city": "Rome"}}}],
        },
    ]  # fmt: skip
    listed = listed_tools([ToolDefinition.model_validate(t) for t in TOOLS], "hermes")
    rendered_messages, tools = template_inputs(messages, listed, tokenizer, "hermes")
    assert rendered_messages == messages and tools == TOOLS
    text = tokenizer.apply_chat_template(rendered_messages, tools=tools)
    assert text == "TOOLS:get_weather;user:hi|assistant:[get_weather(Rome)]|"


def test_streamed_token_ids_survive_a_held_back_tool_call(serve):
    """Text held back as a possible tool call still sends its token ids, with the next
    chunk of its choice."""
    engine, client = serve(HERMES_REPLY, **AUTO)
    chunks = client.chat.completions.create(
        model="m",
        messages=ASK,
        tools=TOOLS,
        stream=True,
        max_tokens=len(HERMES_REPLY),
        extra_body={"return_token_ids": True},
    )
    token_ids = [i for c in chunks for i in c.choices[0].model_extra.get("token_ids") or ()]
    assert token_ids == engine.tokenizer.encode(HERMES_REPLY, add_special_tokens=False)
