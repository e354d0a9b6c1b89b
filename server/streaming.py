"""Running one request on the engine: timing it, turning engine errors into APIErrors, and
answering it whole or as server-sent events.

The engine client's stream aborts the request in the engine when its consumer stops early
(cancelled, or closed); every generator here closes the one it reads, so a client that
disconnects, at any point, aborts its request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request

from ipc.client import EngineDeadError, RequestError
from ipc.messages import SamplingParams, TokenLogprobs
from ipc.outputs import RequestOutput
from server.errors import UNEXPECTED, ClientDisconnected, engine_error
from server.metrics import ServerMetrics
from server.protocol import APIError
from server.responses import ResponseBuilder

T = TypeVar("T")
logger = logging.getLogger(__name__)
# Line separators some SSE and JSON-lines clients split on; JSON strings may hold them
# raw, so they are sent escaped.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\u0085": "\\u0085"})


@dataclass(frozen=True)
class Submission:
    """One request as the engine client takes it, with its arrival time."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    arrival: float
    cache_salt: str | None = None
    priority: int = 0


async def engine_outputs(
    client, submission: Submission, metrics: ServerMetrics
) -> AsyncIterator[RequestOutput]:
    """The engine client's stream of deltas, timed into the metrics; its errors become
    APIErrors."""
    s = submission
    last_token_time = None
    finish_reason = "abort"
    started = False
    num_tokens = 0
    try:
        stream = client.stream(
            s.prompt_token_ids,
            s.params,
            request_id=s.request_id,
            priority=s.priority,
            cache_salt=s.cache_salt,
        )
        async with aclosing(stream):
            async for out in stream:
                now = time.perf_counter()
                if out.outputs[0].token_ids:
                    num_tokens += len(out.outputs[0].token_ids)
                    if last_token_time is None:
                        metrics.observe_first_token(now - s.arrival)
                    else:
                        metrics.observe_inter_token(now - last_token_time)
                    last_token_time = now
                if out.finished:
                    finish_reason = out.outputs[0].finish_reason or "abort"
                started = True
                yield out
    except (RequestError, EngineDeadError) as e:
        finish_reason = "error" if started else None
        raise engine_error(e, s.request_id) from e
    except ValueError as e:  # the engine client refused it: a request id already running
        finish_reason = None
        raise APIError(400, str(e)) from e
    finally:
        if finish_reason is not None:
            seconds = time.perf_counter() - s.arrival
            metrics.observe_finished(finish_reason, seconds, len(s.prompt_token_ids), num_tokens)


async def complete(
    outputs: AsyncIterator[RequestOutput],
    builder: ResponseBuilder,
    num_prompt_tokens: int,
    want_logprobs: bool,
) -> dict:
    """The whole response of a non-streaming request."""
    texts: list[str] = []
    logprobs: list[TokenLogprobs] = []
    num_tokens = 0
    async with aclosing(outputs):
        async for out in outputs:
            delta = out.outputs[0]
            texts.append(delta.text)
            num_tokens += len(delta.token_ids)
            logprobs.extend(delta.logprobs or ())
            last = out
    return builder.response(
        "".join(texts),
        logprobs if want_logprobs else None,
        last.outputs[0].finish_reason,
        last.outputs[0].stop_reason,
        builder.usage(num_prompt_tokens, num_tokens, last.num_cached_tokens),
    )


async def event_stream(
    first: RequestOutput | None,
    outputs: AsyncIterator[RequestOutput],
    builder: ResponseBuilder,
    num_prompt_tokens: int,
    want_logprobs: bool,
    include_usage: bool,
    continuous_usage: bool = False,
) -> AsyncIterator[str]:
    """Server-sent events of OpenAI chunks, `first` (already taken from `outputs`) first,
    then an optional usage chunk, then `data: [DONE]`; with `continuous_usage` (vLLM's)
    every chunk carries the usage so far. An error after the first chunk ends the chunks
    with an error event (then `data: [DONE]`)."""
    num_tokens = 0
    num_cached_tokens = 0
    async with aclosing(outputs):
        out = first
        try:
            for chunk in builder.first_chunks():
                yield _event(chunk)
            while out is not None:
                delta = out.outputs[0]
                num_tokens += len(delta.token_ids)
                num_cached_tokens = out.num_cached_tokens
                logprobs = delta.logprobs if want_logprobs else None
                if delta.text or logprobs or out.finished:
                    end = (delta.finish_reason, delta.stop_reason) if out.finished else ()
                    chunk = builder.chunk(delta.text, logprobs, *end)
                    if chunk is not None:
                        if continuous_usage:
                            usage = builder.usage(num_prompt_tokens, num_tokens, num_cached_tokens)
                            chunk["usage"] = usage
                        yield _event(chunk)
                out = await anext(outputs, None)
        except APIError as e:
            yield _event(e.body())
            include_usage = False
        except Exception:
            logger.exception("request %s failed while streaming", builder.request_id)
            yield _event(APIError(500, UNEXPECTED).body())
            include_usage = False
    if include_usage:
        usage = builder.usage(num_prompt_tokens, num_tokens, num_cached_tokens)
        yield _event(builder.usage_chunk(usage))
    yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    data = json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS)
    return f"data: {data}\n\n"


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, unless the HTTP client disconnects first: then cancel it and raise
    ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()
    await asyncio.wait((task,))
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
