"""The engine's command-line flags, made from EngineConfig's fields (as vLLM's
`EngineArgs.add_cli_args`): a field with an `option(...)` in its metadata becomes
`--kebab-name` (or the flags it names), typed by its annotation, with its help text and
its default."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import types
import typing
from pathlib import Path
from typing import Any

from ipc.config import EngineConfig


def engine_options() -> list[dataclasses.Field]:
    """The fields of EngineConfig that are command-line options."""
    return [f for f in dataclasses.fields(EngineConfig) if "help" in f.metadata]


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """One flag per option field, in a group "engine". Every flag defaults to None, so
    that what was not given takes EngineConfig's default."""
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in engine_options():
        meta = f.metadata
        flags = meta["flags"] or ("--" + f.name.replace("_", "-"),)
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": _help(f)}
        kind = _unwrap_optional(hints[f.name])
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is list:
            (kwargs["type"],) = typing.get_args(kind)
            kwargs["nargs"] = "+"
        else:
            kwargs["type"] = meta["parse"] or kind
        if meta["choices"] is not None:
            kwargs["choices"] = meta["choices"]
        if meta["metavar"] is not None:
            kwargs["metavar"] = meta["metavar"]
        group.add_argument(*flags, **kwargs)
    return parser


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed flags: the one a parent process passed as JSON
    (`--config-json`), else the engine flags given over EngineConfig's defaults, with
    torchrun's WORLD_SIZE as the tensor-parallel size and the default model when none
    is named."""
    if getattr(args, "config_json", None):
        return EngineConfig(**json.loads(args.config_json))
    given = {f.name: getattr(args, f.name) for f in engine_options()}
    kwargs = {name: value for name, value in given.items() if value is not None}
    if "WORLD_SIZE" in os.environ:  # torchrun
        kwargs.setdefault("tensor_parallel_size", int(os.environ["WORLD_SIZE"]))
    if "model" not in kwargs:
        from models.default import default_model_path

        kwargs["model"] = default_model_path()
    return make_engine_config(**kwargs)


def make_engine_config(**kwargs: Any) -> EngineConfig:
    """EngineConfig(**kwargs); a .gguf model's metadata is first converted (once, cached)
    into the folder of its config and tokenizer, given as hf_config_path. A draft model
    must have the target's tokenizer (checked here, before any process starts)."""
    model = kwargs.get("model")
    if model is not None and str(model).endswith(".gguf") and not kwargs.get("hf_config_path"):
        kwargs["hf_config_path"] = _model_folder(model)
    config = EngineConfig(**kwargs)
    spec = config.speculative_config
    if spec is not None and spec.model is not None and config.tokenizer is not None:
        check_draft_tokenizer(config.tokenizer, spec.model)
    return config


def check_draft_tokenizer(target_tokenizer: str, draft_model: str) -> None:
    """The draft's vocabulary (token -> id) must be the target's, token for token."""
    from transformers import AutoTokenizer

    folder = _model_folder(draft_model)
    if not (Path(folder) / "config.json").is_file():
        raise ValueError(f"speculative_config: draft model {draft_model} is not a model folder")
    target = AutoTokenizer.from_pretrained(target_tokenizer).get_vocab()
    draft = AutoTokenizer.from_pretrained(folder).get_vocab()
    if draft != target:
        differ = sum(draft.get(token) != i for token, i in target.items())
        raise ValueError(
            f"speculative_config: draft model {draft_model} has another tokenizer than the "
            f"target ({len(draft)} tokens vs {len(target)}, {differ} of the target's differ)"
        )


def _model_folder(model: str) -> str:
    """A model folder as it is; a .gguf file's converted folder (config, tokenizer)."""
    if not str(model).endswith(".gguf"):
        return model
    from models.gguf_folder import gguf_hf_folder

    return gguf_hf_folder(model)


def _help(f: dataclasses.Field) -> str:
    default = f.metadata["default_text"]
    if default is None:
        default = f.default
        if isinstance(default, bool):
            default = "on" if default else "off"
        elif isinstance(default, enum.Enum):
            default = default.value
    return f"{f.metadata['help']} (default: {default})"


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return inner
    return annotation
