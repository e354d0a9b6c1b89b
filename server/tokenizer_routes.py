"""vLLM's /tokenize and /detokenize, and /version."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Any

from fastapi import FastAPI
from pydantic import model_validator

from ipc.tokenizer import TokenizerLike
from server.inputs import PromptLimits, chat_ids, chat_messages
from server.protocol import APIError, ChatMessage, Int64, RequestBody, Text, ToolDefinition
from server.tools import listed_tools, template_inputs


class TokenizeRequest(RequestBody):
    """Either `prompt` (a text) or `messages` (a chat, the template applied)."""

    NO_OP_VALUES = {"return_token_strs": (False,), "chat_template": ()}

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    tools: list[ToolDefinition] | None = None  # rendered as a chat with these tools renders

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
    tool_parser: str | None = None,
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
            tokens = await off_loop(_chat_tokens, request, tokenizer, tool_parser)
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


def _chat_tokens(
    request: TokenizeRequest, tokenizer: TokenizerLike, tool_parser: str | None
) -> list[int]:
    """Counting a prompt too long to serve is what this is for: no length limit."""
    tools = listed_tools(request.tools, tool_parser)
    messages, template_tools = template_inputs(
        chat_messages(request.messages), tools, tokenizer, tool_parser
    )
    options = (request.add_generation_prompt, request.continue_final_message)
    return chat_ids(messages, *options, tokenizer, PromptLimits(), template_tools)
