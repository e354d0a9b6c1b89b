"""Options whose value is a JSON object (`--speculative-config`, `--kv-transfer-config`):
a dataclass made from itself, a dict or JSON text, unknown keys refused by name."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


def json_object(value: dict[str, Any] | str, name: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return value


def from_json_value(cls: type[T], value: T | dict[str, Any] | str, name: str) -> T:
    if isinstance(value, cls):
        return value
    value = json_object(value, name)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(
            f"{name}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return cls(**value)


def json_option_parser(from_value: Callable[[str], Any]) -> Callable[[str], dict[str, Any]]:
    """An argparse type: the option's JSON, checked now, as a dict."""

    def parse(text: str) -> dict[str, Any]:
        try:
            return vars(from_value(text))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse
