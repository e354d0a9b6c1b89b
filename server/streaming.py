"""Running one request on the engine: timing it, turning engine errors into APIErrors, and
answering it whole or as server-sent events.

The engine client's stream aborts the request in the engine when its consumer stops early
(cancelled, or closed); every generator here closes the one it reads, so a client that
disconnects, at any point, aborts its request.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request

from ipc.client import EngineDeadError, RequestError
from ipc.client.parallel_sampling import num_candidates
from ipc.messages import SamplingParams, TokenLogprobs
from ipc.outputs import CompletionOutput, RequestOutput
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
    APIErrors. A request with best_of > n cannot stream: its one output is the answer."""
    s = submission
    last_token_time = None
    finish_reason = "abort"
    started = False
    num_tokens = 0
    try:
        run = client.stream
        if num_candidates(s.params) > s.params.n:
            run = functools.partial(_whole, client)
        stream = run(
            s.prompt_token_ids,
            s.params,
            request_id=s.request_id,
            priority=s.priority,
            cache_salt=s.cache_salt,
        )
        async with aclosing(stream):
            async for out in stream:
                now = time.perf_counter()
                num_new = sum(len(choice.token_ids) for choice in out.outputs)
                if num_new:
                    num_tokens += num_new
                    if last_token_time is None:
                        metrics.observe_first_token(now - s.arrival)
                    else:
                        metrics.observe_inter_token(now - last_token_time)
                    last_token_time = now
                if out.finished:
                    finish_reason = next((c.finish_reason for c in out.outputs), None) or "abort"
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


async def _whole(client, *args, **kwargs) -> AsyncIterator[RequestOutput]:
    """client.generate's answer as a stream of one output."""
    yield await client.generate(*args, **kwargs)


async def complete(
    outputs: AsyncIterator[RequestOutput],
    builder: ResponseBuilder,
    num_prompt_tokens: int,
    want_logprobs: bool,
) -> dict:
    """The whole response of a non-streaming request: its choices' deltas joined."""
    texts: dict[int, list[str]] = defaultdict(list)
    logprobs: dict[int, list[TokenLogprobs]] = defaultdict(list)
    ends: dict[int, CompletionOutput] = {}  # each choice's last delta
    num_tokens = 0
    async with aclosing(outputs):
        async for out in outputs:
            builder.add_prompt_logprobs(out.prompt_logprobs)
            for delta in out.outputs:
                texts[delta.index].append(delta.text)
                num_tokens += len(delta.token_ids)
                logprobs[delta.index].extend(delta.logprobs or ())
                ends[delta.index] = delta
            last = out
    choices = [
        CompletionOutput(
            index,
            "".join(texts[index]),
            [],
            ends[index].finish_reason,
            logprobs[index] if want_logprobs else None,
            ends[index].stop_reason,
        )
        for index in sorted(ends)
    ]
    usage = builder.usage(num_prompt_tokens, num_tokens, last.num_cached_tokens)
    return builder.response(choices, usage)


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
                num_cached_tokens = out.num_cached_tokens
                builder.add_prompt_logprobs(out.prompt_logprobs)
                for delta in out.outputs:
                    num_tokens += len(delta.token_ids)
                    logprobs = delta.logprobs if want_logprobs else None
                    finished = delta.finish_reason is not None
                    if delta.text or logprobs or finished:
                        end = (delta.finish_reason, delta.stop_reason) if finished else ()
                        chunk = builder.chunk(delta.index, delta.text, logprobs, *end)
                        if chunk is None:  # held back (a tool call may be starting)
                            continue
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
