"""vLLM's /tokenize and /detokenize, and /version."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Any

from fastapi import FastAPI
from pydantic import model_validator

from ipc.tokenizer import TokenizerLike
from server.inputs import PromptLimits, chat_ids
from server.protocol import APIError, ChatMessage, Int64, RequestBody, Text


class TokenizeRequest(RequestBody):
    """Either `prompt` (a text) or `messages` (a chat, the template applied)."""

    NO_OP_VALUES = {"return_token_strs": (False,), "tools": ([],), "chat_template": ()}

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either `prompt` or `messages`")
        return self


class DetokenizeRequest(RequestBody):
    model: Text | None = None
    tokens: list[Int64]


def server_version() -> str:
    try:
        return metadata.version("splitserve")
    except metadata.PackageNotFoundError:
        return "unknown"


def add_tokenizer_routes(
    app: FastAPI,
    tokenizer: TokenizerLike,
    limits: PromptLimits,
    check_model: Callable[[str | None], None],
    off_loop: Callable[..., Awaitable[Any]],
) -> None:
    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict:
        check_model(request.model)
        if request.messages is None:
            special = request.add_special_tokens is not False
            tokens = await off_loop(tokenizer.encode, request.prompt, special)
        else:
            if request.add_special_tokens:
                message = "`add_special_tokens` is not supported with `messages`"
                raise APIError(400, message, "add_special_tokens")
            generation_prompt = request.add_generation_prompt
            # Counting a prompt too long to serve is what this is for: no length limit.
            unbounded = PromptLimits()
            tokens = await off_loop(
                chat_ids, request.messages, generation_prompt, tokenizer, unbounded
            )
        return {"count": len(tokens), "max_model_len": limits.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict:
        check_model(request.model)
        if request.tokens:
            limits.check_token_ids(request.tokens, "tokens")
        return {"prompt": await off_loop(tokenizer.decode, request.tokens, False)}

    @app.get("/version")
    async def version() -> dict:
        return {"version": server_version()}
