"""The OpenAI-compatible FastAPI app over an AsyncEngineClient."""

from __future__ import annotations

import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from ipc.client import EngineDeadError
from ipc.messages import SamplingParams
from server.inputs import Tokenizer, chat_prompt_ids, completion_prompt_ids, sampling_params
from server.metrics import ServerMetrics
from server.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingFields
from server.responses import ChatResponses, CompletionResponses, ResponseBuilder
from server.streaming import (
    ClientDisconnected,
    cancel_on_disconnect,
    complete,
    engine_outputs,
    event_stream,
)


def build_app(
    client,
    tokenizer: Tokenizer,
    served_model_name: str,
    api_key: str | None = None,
    max_model_len: int | None = None,
    sampling_defaults: dict | None = None,
) -> FastAPI:
    """`client` is a connected AsyncEngineClient (or anything with its generate/stream/abort/
    stats/health methods); the app never connects or closes it. `sampling_defaults` (the
    model's generation config) apply under what each request sets."""
    app = FastAPI(title="splitserve")
    metrics = ServerMetrics()
    created = int(time.time())
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    _add_error_handlers(app)

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            message = f"The model `{name}` does not exist (this server has `{served_model_name}`)."
            raise APIError(404, message, "model", "model_not_found")

    async def answer(
        raw: Request,
        request: SamplingFields,
        builder: ResponseBuilder,
        prompt_token_ids: list[int],
        want_logprobs: bool,
        params: SamplingParams,
        arrival: float,
    ) -> Response:
        outputs = engine_outputs(
            client, prompt_token_ids, params, builder.request_id, metrics, arrival
        )
        num_prompt_tokens = len(prompt_token_ids)
        if not request.stream:
            work = complete(outputs, builder, num_prompt_tokens, want_logprobs)
            return JSONResponse(await cancel_on_disconnect(raw, work))
        # The first output is awaited here so a request the engine rejects is an HTTP error.
        first = await cancel_on_disconnect(raw, anext(outputs, None))
        events = event_stream(
            first, outputs, builder, num_prompt_tokens, want_logprobs, request.include_usage
        )
        return StreamingResponse(events, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        check_model(request.model)
        prompt_token_ids = completion_prompt_ids(request, tokenizer)
        params = sampling_params(
            request,
            len(prompt_token_ids),
            request.max_tokens,
            request.logprobs,
            max_model_len,
            sampling_defaults,
        )
        builder = CompletionResponses(f"cmpl-{uuid.uuid4().hex}", served_model_name, tokenizer)
        want_logprobs = request.logprobs is not None
        return await answer(raw, request, builder, prompt_token_ids, want_logprobs, params, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        prompt_token_ids = chat_prompt_ids(request, tokenizer)
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        num_prompt_tokens = len(prompt_token_ids)
        params = sampling_params(
            request, num_prompt_tokens, max_tokens, logprobs, max_model_len, sampling_defaults
        )
        builder = ChatResponses(f"chatcmpl-{uuid.uuid4().hex}", served_model_name, tokenizer)
        want_logprobs = bool(request.logprobs)
        return await answer(raw, request, builder, prompt_token_ids, want_logprobs, params, arrival)

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

    @app.get("/health")
    async def health() -> Response:
        serving = await client.health(timeout=5.0)
        return Response(status_code=200 if serving else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        try:
            stats = await client.stats(timeout=5.0)
        except EngineDeadError:
            stats = None
        return Response(metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> Response:
        error = exc.errors()[0]
        loc = [str(part) for part in error["loc"] if part != "body"]
        param = loc[0] if loc else None
        message = f"invalid value for {param}: {error['msg']}" if param else error["msg"]
        return JSONResponse(APIError(400, message, param).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        body = APIError(exc.status_code, str(exc.detail)).body()
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)


class BearerAuth:
    """ASGI middleware: /v1/* needs `Authorization: Bearer <api_key>`."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self.expected):
                message = "Invalid API key: send it as 'Authorization: Bearer <key>'."
                error = APIError(401, message, code="invalid_api_key")
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
