"""Tool-call parsers, under vLLM's names: how a model family writes a tool call, read back
out of the text it generated (`parse`), found early enough while streaming that no part of
a call is sent as content (`content_end`), and written for a chat template that has no
tools section (`describe_tools`, `render_calls`, `render_result`).

`hermes`: Hermes, Qwen2.5 and Qwen3 models write each call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, after optional text.
`llama3_json`: Llama 3.x writes one JSON object, `{"name": ..., "parameters": {...}}`
(several joined by ";"), optionally after `<|python_tag|>`, and nothing else.

Text that does not parse as the format's calls is content, as vLLM treats it.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=_call_id)

    def as_dict(self) -> dict:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


class ToolParser(ABC):
    name: ClassVar[str]

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content and the tool calls in a model's whole output; no calls when the
        text does not hold the format's calls (then all of it is content)."""

    @abstractmethod
    def content_end(self, text: str) -> int:
        """How many leading characters of an output so far are content whatever follows;
        the rest may begin a tool call and is held back while streaming."""

    @abstractmethod
    def describe_tools(self, tools: list[dict]) -> str:
        """A system message telling the model the tools and the format of a call."""

    @abstractmethod
    def render_calls(self, calls: list[dict]) -> str:
        """An assistant's earlier calls (OpenAI's `tool_calls`) as the model writes them."""

    def render_result(self, content: str) -> str:
        return content


def _functions(tools: list[dict]) -> str:
    return "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)


def _arguments(call: dict) -> object:
    """A call's arguments as a JSON value (OpenAI sends them as JSON text)."""
    arguments = call["function"].get("arguments", "{}")
    try:
        return json.loads(arguments)
    except (TypeError, json.JSONDecodeError):
        return arguments


def _as_call(obj: object, arguments_key: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a tool call is an object with a string `name`")
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):
        json.loads(arguments)
        return ToolCall(obj["name"], arguments)
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _held_marker_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        try:
            calls = [_as_call(json.loads(body), "arguments") for body in self._CALL.findall(text)]
        except (ValueError, TypeError):
            return text, []
        return text[:start].strip() or None, calls

    def content_end(self, text: str) -> int:
        start = text.find(self.START)
        if start >= 0:
            return start
        return len(text) - _held_marker_prefix(text, self.START)

    def describe_tools(self, tools: list[dict]) -> str:
        return (
            "# Tools\n\nYou may call one or more of these functions, described as JSON "
            f"within <tools></tools> tags:\n<tools>\n{_functions(tools)}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and arguments within "
            '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function name>, '
            '"arguments": <arguments as a JSON object>}\n</tool_call>'
        )

    def render_calls(self, calls: list[dict]) -> str:
        bodies = (
            json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)}) for c in calls
        )
        return "\n".join(f"{self.START}\n{body}\n{self.END}" for body in bodies)

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self.PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, index = json.JSONDecoder(), [], 0
        try:
            while index < len(body):
                obj, index = decoder.raw_decode(body, index)
                calls.append(_as_call(obj, "parameters"))
                index = _skip_separator(body, index)
        except (ValueError, TypeError):
            return text, []
        return None, calls

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or _begins(body, self.PYTHON_TAG):
            return 0
        return len(text)

    def describe_tools(self, tools: list[dict]) -> str:
        return (
            "You may call one of these functions, described as JSON:\n"
            f"{_functions(tools)}\n\nTo call a function, answer with nothing but a JSON "
            'object: {"name": <function name>, "parameters": <arguments as a JSON object>}.'
        )

    def render_calls(self, calls: list[dict]) -> str:
        return "; ".join(
            json.dumps({"name": c["function"]["name"], "parameters": _arguments(c)}) for c in calls
        )


def _skip_separator(body: str, index: int) -> int:
    while index < len(body) and body[index] in " \t\r\n;":
        index += 1
    return index


def _begins(text: str, marker: str) -> bool:
    """Whether `text` begins with `marker`, or is a beginning of it."""
    return text.startswith(marker) or marker.startswith(text)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser)
}
