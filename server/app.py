"""The OpenAI-compatible FastAPI app over an AsyncEngineClient."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ipc.sampling_params import SamplingParams
from ipc.tokenizer import TokenizerLike
from server.auth import BearerAuth, authenticated_key, tenant_cache_salt
from server.errors import add_error_handlers
from server.inputs import (
    PromptLimits,
    chat_echo,
    chat_prompt_ids,
    completion_prompts,
    echo_texts,
    sampling_params,
)
from server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES, BodyLimit
from server.metrics import ServerMetrics
from server.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingFields
from server.request_ids import RequestIdHeader, request_id
from server.responses import ChatResponses, CompletionResponses, ResponseBuilder
from server.streaming import (
    PromptStream,
    Submission,
    cancel_on_disconnect,
    complete,
    engine_outputs,
    event_stream,
    first_outputs,
)
from server.structured_output import check_structured_outputs
from server.tokenizer_routes import add_tokenizer_routes
from server.tools import tool_choice

T = TypeVar("T")
TOKENIZER_THREADS = 4


def build_app(
    client,
    tokenizer: TokenizerLike,
    served_model_name: str,
    api_keys: str | Sequence[str] | None = None,
    max_model_len: int | None = None,
    sampling_defaults: dict | None = None,
    vocab_size: int | None = None,
    salt_cache_by_api_key: bool = False,
    enable_prompt_tokens_details: bool = False,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    scheduling_policy: str | None = None,
    cors: dict | None = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """`client` is a connected AsyncEngineClient or DataParallelClient (or anything with
    their generate/stream/abort/engine_stats/engine_index/health methods); the app never
    connects or closes it. `sampling_defaults` (the
    model's generation config) apply under what each request sets. `api_keys` (one or
    several) guard /v1; with `salt_cache_by_api_key` each key's requests share prefix-cache
    blocks only among themselves. `vocab_size` bounds the token ids a request may send.
    `scheduling_policy` is the engine's: under "fcfs" a request's `priority` must be 0
    (None: unknown, any priority is passed on). `cors`: CORSMiddleware's keyword arguments
    (None: no CORS headers). `tool_call_parser` (a name of server/tool_parsers.py) reads
    tool calls out of the text when `enable_auto_tool_choice` lets the model choose them."""
    keys = [api_keys] if isinstance(api_keys, str) else list(api_keys or ())
    if salt_cache_by_api_key and not keys:
        raise ValueError("salt_cache_by_api_key needs API keys")
    tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenizer")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="splitserve", lifespan=lifespan)
    metrics = ServerMetrics(served_model_name, max_model_len)
    created = int(time.time())
    limits = PromptLimits(max_model_len, vocab_size, tokenizer.min_num_tokens)
    app.add_middleware(BodyLimit, max_bytes=max_request_body_bytes)
    if keys:
        app.add_middleware(BearerAuth, api_keys=keys)
    app.add_middleware(RequestIdHeader)
    if cors is not None:  # outermost: a preflight carries no API key
        app.add_middleware(CORSMiddleware, **cors)
    add_error_handlers(app)

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            message = f"The model `{name}` does not exist (this server has `{served_model_name}`)."
            raise APIError(404, message, "model", "model_not_found")

    def check_request(request: SamplingFields) -> None:
        """What the body alone cannot tell: the model is this one, a priority can be kept."""
        check_model(request.model)
        if request.priority and scheduling_policy == "fcfs":
            message = (
                "`priority` is not supported: the engine schedules first come, first served "
                "(start it with --scheduling-policy priority)"
            )
            raise APIError(400, message, "priority")
        if request.prompt_logprobs is not None and request.stream:
            message = "`prompt_logprobs` is not available with `stream` (as in vLLM)"
            raise APIError(400, message, "prompt_logprobs")
        if request.stream_options is not None and not request.stream:
            message = "`stream_options` can only be given with `stream: true`"
            raise APIError(400, message, "stream_options")

    async def off_loop(work: Callable[..., T], *args) -> T:
        """Tokenizing (a long prompt takes seconds) never holds up the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(tokenizer_pool, functools.partial(work, *args))

    def cache_salt(raw: Request, request: SamplingFields) -> str | None:
        if not salt_cache_by_api_key:
            return request.cache_salt
        return tenant_cache_salt(authenticated_key(raw), request.cache_salt)

    def responses_for(
        kind: type[ResponseBuilder], response_id: str, request: SamplingFields
    ) -> ResponseBuilder:
        builder = kind(response_id, served_model_name, tokenizer, enable_prompt_tokens_details)
        builder.show_prompt_logprobs = request.prompt_logprobs is not None
        builder.return_token_ids = bool(request.return_token_ids)
        builder.tokens_as_ids = bool(request.return_tokens_as_token_ids)
        return builder

    async def answer(
        raw: Request,
        request: SamplingFields,
        prompts: list[tuple[ResponseBuilder, list[int], SamplingParams]],
        want_logprobs: bool,
        arrival: float,
    ) -> Response:
        """Runs each (builder, prompt token ids, params) as its own engine request (a
        batch's as `<id>-<i>`) and answers them as one response."""
        if request.kv_transfer_params is not None and len(prompts) > 1:
            raise APIError(400, "kv_transfer_params takes a single prompt", "kv_transfer_params")
        streams = []
        for i, (builder, prompt_token_ids, params) in enumerate(prompts):
            builder.num_choices = params.n
            builder.prompt_token_ids = prompt_token_ids
            engine_id = builder.request_id if len(prompts) == 1 else f"{builder.request_id}-{i}"
            submission = Submission(
                prompt_token_ids,
                params,
                engine_id,
                arrival,
                cache_salt(raw, request),
                request.priority or 0,
            )
            outputs = engine_outputs(client, submission, metrics)
            streams.append(PromptStream(outputs, builder, len(prompt_token_ids)))
        if not request.stream:
            work = complete(streams, want_logprobs)
            return JSONResponse(await cancel_on_disconnect(raw, work))
        firsts = await cancel_on_disconnect(raw, first_outputs(streams))
        events = event_stream(
            streams, firsts, want_logprobs, request.include_usage, request.continuous_usage
        )
        return StreamingResponse(events, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        check_request(request)
        prompts = await off_loop(completion_prompts, request, tokenizer, limits)
        response_id = f"cmpl-{request_id(raw, request.request_id)}"
        builders = [responses_for(CompletionResponses, response_id, request) for _ in prompts]
        if request.echo:
            texts = await off_loop(echo_texts, request, prompts, tokenizer)
            for builder, text in zip(builders, texts, strict=True):
                builder.echo = text
                builder.echo_logprobs = request.logprobs is not None
        parts = []
        for builder, prompt_token_ids in zip(builders, prompts, strict=True):
            params = sampling_params(
                request,
                len(prompt_token_ids),
                request.max_tokens,
                request.logprobs,
                limits,
                sampling_defaults,
            )
            builder.first_index = len(parts) * params.n
            parts.append((builder, prompt_token_ids, params))
        return await answer(raw, request, parts, request.logprobs is not None, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        check_request(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        tools = tool_choice(request, tool_call_parser, enable_auto_tool_choice)
        forced_calls = None if tools is None else tools.structured_outputs()
        if forced_calls is not None:
            await off_loop(check_structured_outputs, forced_calls, "tools")
        prompt_token_ids = await off_loop(
            chat_prompt_ids, request, tokenizer, limits, tools, tool_call_parser
        )
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        num_prompt_tokens = len(prompt_token_ids)
        params = sampling_params(
            request, num_prompt_tokens, max_tokens, logprobs, limits, sampling_defaults
        )
        if forced_calls is not None:
            if params.structured_outputs is not None:
                message = (
                    "`tool_choice` required or named cannot be combined with structured output"
                )
                raise APIError(400, message, "tool_choice")
            params = msgspec.structs.replace(params, structured_outputs=forced_calls)
        response_id = f"chatcmpl-{request_id(raw, request.request_id)}"
        responses = responses_for(ChatResponses, response_id, request)
        responses.tools = tools
        responses.echo = chat_echo(request)
        responses.top_logprobs = request.top_logprobs or 0
        parts = [(responses, prompt_token_ids, params)]
        return await answer(raw, request, parts, bool(request.logprobs), arrival)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "splitserve",
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [card]}

    add_tokenizer_routes(app, tokenizer, limits, check_model, off_loop, tool_call_parser)

    @app.get("/health")
    async def health() -> Response:
        serving = await client.health(timeout=5.0)
        return Response(status_code=200 if serving else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        stats = await client.engine_stats(timeout=5.0)
        return Response(metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    return app
