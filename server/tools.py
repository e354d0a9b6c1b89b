"""Tool calls in chat completions: what a request's `tools` and `tool_choice` ask for, the
prompt that shows the model its tools, and the model's text turned into `tool_calls`.

`tool_choice`:
* "none": the tools are in the prompt; the output is plain content.
* "auto" (the default when tools are given): the server's tool-call parser
  (`--enable-auto-tool-choice --tool-call-parser NAME`) reads calls out of the output.
* "required": structured output makes the model write a JSON array of one or more
  `{"name": ..., "parameters": {...}}` objects, one of the tools each (one only with
  `parallel_tool_calls: false`), so the calls always parse.
* a named function: structured output makes the model write that function's arguments.
Both are compact JSON (no free whitespace, which small models repeat without end).

A chat template without a tools section gets the tools described in a system message (in
the parser's format), earlier calls written as the model writes them and tool results
wrapped as the parser's family expects.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ipc.sampling_params import StructuredOutputsParams
from ipc.tokenizer import Message, TokenizerLike
from server.protocol import APIError, ChatCompletionRequest, ToolDefinition
from server.tool_parsers import TOOL_PARSERS, ToolCall, ToolParser

_ANY_OBJECT = {"type": "object"}


@dataclass
class ToolChoice:
    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict]
    parser: ToolParser
    function: str | None = None  # the named function
    parallel: bool = True

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """What "required" and named choices make the output match."""
        if self.mode == "named":
            schema = _parameters(self.tools, self.function)
        elif self.mode == "required":
            schema = _calls_schema(self.tools, self.parallel)
        else:
            return None
        return StructuredOutputsParams(json=json.dumps(schema), disable_any_whitespace=True)

    def output(self) -> ToolCallOutput:
        return ToolCallOutput(self)


def tool_choice(
    request: ChatCompletionRequest, parser_name: str | None, auto_tool_choice: bool
) -> ToolChoice | None:
    """What the request asks of tools, checked (a 400 naming the field otherwise); None
    without tools."""
    tools = _as_dicts(request.tools)
    choice = request.tool_choice
    if not tools:  # "auto" among no tools is no call
        if choice not in (None, "none", "auto"):
            raise APIError(400, "`tool_choice` needs `tools`", "tool_choice")
        return None
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) < len(names):
        raise APIError(400, "every tool must have its own name", "tools")
    mode = choice or "auto"
    function = None
    if not isinstance(mode, str):
        function, mode = mode.function.name, "named"
        if function not in names:
            message = f"`tool_choice` names `{function}`, which is not a tool"
            raise APIError(400, message, "tool_choice")
    if mode == "auto" and not (auto_tool_choice and parser_name):
        message = (
            '"auto" tool choice needs the server started with --enable-auto-tool-choice '
            'and --tool-call-parser; ask for tool_choice "required" or a named function'
        )
        raise APIError(400, message, "tool_choice")
    for i, tool in enumerate(tools):
        if tool["function"].get("strict") and mode in ("none", "auto"):
            message = (
                '`strict` tools are enforced only when tool_choice is "required" or a '
                "named function"
            )
            raise APIError(400, message, f"tools[{i}].function.strict")
    parallel = request.parallel_tool_calls is not False
    return ToolChoice(mode, tools, _parser(parser_name), function, parallel)


def listed_tools(tools: list[ToolDefinition] | None, parser_name: str | None) -> ToolChoice | None:
    """Tools shown to the model and never parsed (tool_choice "none")."""
    if not tools:
        return None
    return ToolChoice("none", _as_dicts(tools), _parser(parser_name))


def _parser(name: str | None) -> ToolParser:
    """The server's tool-call parser; hermes writes the tools for a server without one."""
    return TOOL_PARSERS[name or "hermes"]()


def _as_dicts(tools: list[ToolDefinition] | None) -> list[dict]:
    return [tool.model_dump(exclude_none=True) for tool in tools or ()]


def _parameters(tools: list[dict], name: str | None) -> dict:
    function = next(t["function"] for t in tools if t["function"]["name"] == name)
    return function.get("parameters") or _ANY_OBJECT


def _calls_schema(tools: list[dict], parallel: bool) -> dict:
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool["function"]["name"]]},
                "parameters": tool["function"].get("parameters") or _ANY_OBJECT,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return schema if parallel else {**schema, "maxItems": 1}


def template_inputs(
    messages: list[Message],
    choice: ToolChoice | None,
    tokenizer: TokenizerLike,
    parser_name: str | None,
) -> tuple[list[Message], list[dict] | None]:
    """The messages and tools to render. A template that reads `tools` gets them and the
    messages as given; any other gets the tools in a system message (added to the first
    one, or put first) and earlier calls and results written in the parser's format."""
    if tokenizer.chat_template_takes_tools:
        return messages, None if choice is None else choice.tools
    parser = choice.parser if choice else _parser(parser_name)
    messages = [_as_text(m, parser) for m in messages]
    if choice is None:
        return messages, None
    description = parser.describe_tools(choice.tools)
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{description}"}, *messages[1:]], None
    return [{"role": "system", "content": description}, *messages], None


def _as_text(message: Message, parser: ToolParser) -> Message:
    calls = message.get("tool_calls")
    if calls:
        content = "\n".join(filter(None, (message["content"], parser.render_calls(calls))))
        message = {**message, "content": content}
        del message["tool_calls"]
    if message["role"] == "tool":
        message = {**message, "content": parser.render_result(message["content"])}
        message.pop("tool_call_id", None)
    return message


@dataclass
class ToolCallOutput:
    """One choice's output read as tool calls: whole (`message`) or streamed (`feed`, then
    `finish`). A finish by length leaves the text as content."""

    choice: ToolChoice
    text: str = ""
    sent: int = 0  # characters streamed as content
    named_call: ToolCall | None = field(default=None, init=False)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        content, calls = self._parse(text, finish_reason)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.as_dict() for call in calls]
        return message, self._finish_reason(calls, finish_reason)

    def feed(self, text: str) -> dict:
        """The delta for the next piece of text ({} while it is held back)."""
        self.text += text
        mode = self.choice.mode
        if mode == "named":
            return self._named_delta(text)
        if mode == "required":  # one JSON array of calls, read at the end
            return {}
        end = len(self.text) if mode == "none" else self.choice.parser.content_end(self.text)
        start, self.sent = self.sent, max(end, self.sent)
        return _content(self.text[start : self.sent])

    def finish(self, finish_reason: str | None) -> tuple[dict, str | None]:
        """The last delta, and the finish reason to report."""
        if self.choice.mode in ("named", "none"):  # all sent already; a named call "stop"s
            return {}, finish_reason
        _, calls = self._parse(self.text, finish_reason)
        if not calls:
            return _content(self.text[self.sent :]), finish_reason
        delta = {"tool_calls": [_call_delta(i, call) for i, call in enumerate(calls)]}
        return delta, self._finish_reason(calls, finish_reason)

    def _named_delta(self, text: str) -> dict:
        """The call's id and name come with its first piece of arguments."""
        if self.named_call is None:
            self.named_call = ToolCall(self.choice.function, "")
            call = _call_delta(0, self.named_call)
            call["function"]["arguments"] = text
            return {"tool_calls": [call]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}

    def _parse(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall]]:
        mode = self.choice.mode
        if mode == "none" or finish_reason == "length":
            return text, []
        if mode == "named":
            return None, [ToolCall(self.choice.function, text.strip())]
        if mode == "auto":
            return self.choice.parser.parse(text)
        try:
            items = json.loads(text)
            calls = [
                ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                for item in items
            ]
        except (ValueError, TypeError, KeyError):
            return text, []
        return None, calls

    def _finish_reason(self, calls: list[ToolCall], finish_reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call; a forced named call
        finishes with "stop"."""
        if calls and finish_reason == "stop" and self.choice.mode in ("auto", "required"):
            return "tool_calls"
        return finish_reason


def _content(text: str) -> dict:
    return {"content": text} if text else {}


def _call_delta(index: int, call: ToolCall) -> dict:
    return {"index": index, **call.as_dict()}
