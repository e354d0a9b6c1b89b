"""The tool-call parsers and the streaming of tool calls, against hand-written outputs of
each format: a stream, cut anywhere, gives the same content and calls as the whole text."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.tool_parsers import HermesToolParser, Llama3JsonToolParser
from server.tools import ToolCallOutput, ToolChoice

WEATHER = {"name": "get_weather", "parameters": {"type": "object"}}
TOOLS = [{"type": "function", "function": WEATHER}]


def calls_of(calls) -> list[tuple[str, object]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def test_hermes_reads_calls_after_content():
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}'
        "\n</tool_call>"
    )
    content, calls = HermesToolParser().parse(text)
    assert content == "Let me look."
    assert calls_of(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("chatcmpl-tool-")


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny.",
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n["get_weather"]\n</tool_call>',
    ],
)
def test_hermes_leaves_what_does_not_parse_as_content(text):
    assert HermesToolParser().parse(text) == (text, [])


def test_hermes_takes_an_unclosed_last_call():
    _, calls = HermesToolParser().parse('<tool_call>\n{"name": "f", "arguments": {"x": 1}}')
    assert calls_of(calls) == [("f", {"x": 1})]


def test_llama3_json_reads_one_or_several_calls():
    parser = Llama3JsonToolParser()
    text = '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}'
    content, calls = parser.parse(text)
    assert content is None and calls_of(calls) == [("f", {"x": 1}), ("g", {})]
    assert parser.parse('  {"name": "f", "arguments": {"y": [1]}}')[1][0].arguments == '{"y": [1]}'
    for text in ("The answer is 4.", '{"name": "f", "parameters": {}} and more', "{broken"):
        assert parser.parse(text) == (text, [])


@pytest.mark.parametrize("parser", [HermesToolParser(), Llama3JsonToolParser()])
def test_rendered_calls_parse_back(parser):
    calls = [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]
    _, parsed = parser.parse(parser.render_calls(calls))
    assert calls_of(parsed) == [("f", {"x": 1}), ("g", {})]
    description = parser.describe_tools(TOOLS)
    assert json.dumps(WEATHER) in description


def stream(output: ToolCallOutput, pieces: list[str], finish_reason: str):
    """The content and the calls a client puts together from the deltas."""
    content, calls = "", {}
    for piece in pieces:
        delta = output.feed(piece)
        content += delta.get("content", "")
        for call in delta.get("tool_calls", ()):
            calls.setdefault(call["index"], []).append(call)
    delta, finish_reason = output.finish(finish_reason)
    content += delta.get("content", "")
    for call in delta.get("tool_calls", ()):
        calls.setdefault(call["index"], []).append(call)
    merged = []
    for index in sorted(calls):
        name = "".join(part.get("function", {}).get("name", "") for part in calls[index])
        arguments = "".join(part["function"].get("arguments", "") for part in calls[index])
        assert "id" in calls[index][0]
        merged.append((name, json.loads(arguments)))
    return content, merged, finish_reason


OUTPUTS = {
    "hermes": [
        'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "<Paris>"}}\n</tool_call>',
        "No call: a < b and <tool> tags <tool_call",
        "<tool_call>{oops}</tool_call>",
    ],
    "llama3_json": [
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        "  It is {not} a call.",
    ],
}


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_stream_cut_anywhere_gives_the_whole_answer(data):
    name = data.draw(st.sampled_from(sorted(OUTPUTS)))
    text = data.draw(st.sampled_from(OUTPUTS[name]))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    parser = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}[name]()
    choice = ToolChoice("auto", TOOLS, parser)
    message, finish_reason = ToolCallOutput(choice).message(text, "stop")
    content, calls, streamed_finish = stream(ToolCallOutput(choice), pieces, "stop")
    whole_calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls", ())
    ]
    assert calls == whole_calls and streamed_finish == finish_reason
    if whole_calls:
        assert finish_reason == "tool_calls"
        assert content.strip() == (message["content"] or "")
    else:
        assert finish_reason == "stop" and content == text == message["content"]


def test_required_and_named_calls():
    required = ToolChoice("required", TOOLS, HermesToolParser())
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    message, reason = ToolCallOutput(required).message(text, "stop")
    assert reason == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'
    assert stream(ToolCallOutput(required), [text[:9], text[9:]], "stop")[1:] == (
        [("get_weather", {"city": "Rome"})],
        "tool_calls",
    )
    named = ToolChoice("named", TOOLS, HermesToolParser(), "get_weather")
    message, reason = ToolCallOutput(named).message('{"city": "Rome"}', "stop")
    assert reason == "stop" and message["tool_calls"][0]["function"]["name"] == "get_weather"
    pieces = ['{"city"', ': "Ro', 'me"}']
    assert stream(ToolCallOutput(named), pieces, "stop") == (
        "",
        [("get_weather", {"city": "Rome"})],
        "stop",
    )
    # Cut short by max_tokens: the text stays content.
    message, reason = ToolCallOutput(required).message('[{"name": "get_', "length")
    assert reason == "length" and message == {"role": "assistant", "content": '[{"name": "get_'}
