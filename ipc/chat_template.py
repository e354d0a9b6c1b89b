"""Chat templates as transformers renders them: a sandboxed Jinja environment with the
variables and filters transformers gives it, the placeholders that keep special-token text
inside messages from becoming special tokens, and `continue_final_message`'s cut."""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = dict[str, Any]  # one chat message: {"role": ..., "content": ...}


def default_template(template: str | list[dict[str, str]] | None) -> str | None:
    """tokenizer_config.json holds one template, or a list of named ones."""
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


def holds(value: Any, texts: list[str]) -> bool:
    """Whether a message (any string inside it) holds one of `texts`."""
    if isinstance(value, str):
        return any(text in value for text in texts)
    if isinstance(value, dict):
        return any(holds(v, texts) for v in value.values())
    if isinstance(value, list):
        return any(holds(v, texts) for v in value)
    return False


def placeholder_nonce(messages: Any) -> str:
    """Private-use characters that appear in no message; placeholders are built from it."""
    while True:
        nonce = "".join(chr(0xE000 + b) for b in secrets.token_bytes(8))
        if not holds(messages, [nonce]):
            return nonce


def hide(value: Any, texts: list[str], nonce: str) -> Any:
    """`value` with each of `texts` replaced by its placeholder (no letter or space, so a
    template's trim, upper or lower leaves it whole)."""
    if isinstance(value, str):
        if not any(text in value for text in texts):
            return value
        pattern = "|".join(map(re.escape, texts))
        return re.sub(pattern, lambda m: f"{nonce}{chr(0xF000 + texts.index(m[0]))}", value)
    if isinstance(value, dict):
        return {k: hide(v, texts, nonce) for k, v in value.items()}
    if isinstance(value, list):
        return [hide(v, texts, nonce) for v in value]
    return value


def with_end(message: Message, end: str) -> Message:
    """The message with `end` and a space after its content (a template that trims the
    content drops the space)."""
    if not isinstance(message.get("content"), str):
        raise ValueError("continue_final_message: the final message has no text content")
    return {**message, "content": f"{message['content']}{end} "}


def open_final_message(text: str, end: str) -> str:
    """The rendered chat cut where the final message's content ends (`end` marks it);
    when the template trimmed that content, its trailing whitespace goes too."""
    at = text.rfind(end)
    if at < 0:
        raise ValueError("continue_final_message: the chat template left the final message out")
    return text[:at] if text.startswith(f"{end} ", at) else text[:at].rstrip()


def reveal(text: str, texts: list[str], nonce: str) -> str:
    return re.sub(f"{re.escape(nonce)}(.)", lambda m: texts[ord(m[1]) - 0xF000], text, flags=re.S)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


def environment() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
