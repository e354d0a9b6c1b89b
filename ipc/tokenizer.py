"""A Hugging Face tokenizer folder without transformers (which would pull in torch).

tokenizer.json runs through the `tokenizers` library, exactly as transformers' fast
tokenizers do; special tokens come from tokenizer_config.json; the chat template from
chat_template.jinja (which wins, as in transformers) or tokenizer_config.json, rendered
with jinja2 in a sandbox with the variables transformers gives it.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        special_tokens = {
            name: _token_text(config[name])
            for name in _SPECIAL_TOKEN_NAMES
            if config.get(name) is not None
        }
        template_file = folder / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text()
        else:
            template = _default_template(config.get("chat_template"))
        return cls(backend, special_tokens, template)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.backend.token_to_id(self.eos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> str | list[int]:
        """The conversation as the model's prompt text (token ids with tokenize=True,
        without added special tokens: the template writes them)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            self._template = _environment().from_string(self.chat_template)
        text = self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _token_text(token: str | dict[str, Any]) -> str:
    """Special tokens are saved as plain strings or as AddedToken dicts."""
    return token["content"] if isinstance(token, dict) else token


def _default_template(template: str | list[dict[str, str]] | None) -> str | None:
    """tokenizer_config.json holds one template, or a list of named ones."""
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _environment() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
