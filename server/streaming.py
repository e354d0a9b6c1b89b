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
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request

from ipc.client import EngineDeadError, RequestError
from ipc.client.parallel_sampling import num_candidates
from ipc.outputs import CompletionOutput, Logprob, RequestOutput
from ipc.sampling_params import SamplingParams
from server.aio import gather_or_cancel, interleaved
from server.errors import UNEXPECTED, ClientDisconnected, engine_error
from server.metrics import FinishedRequest, ServerMetrics
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
    engine = 0  # the data-parallel engine, known once the request runs
    finish_reason = "abort"
    started = False
    choice_tokens: dict[int, int] = defaultdict(int)
    num_cached_tokens = 0
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
                if not started:  # the engine is chosen by now, for the request's life
                    engine = client.engine_index(s.request_id)
                now = time.perf_counter()
                num_new = 0
                for choice in out.outputs:
                    choice_tokens[choice.index] += len(choice.token_ids)
                    num_new += len(choice.token_ids)
                num_cached_tokens = out.num_cached_tokens
                if num_new:
                    if last_token_time is None:
                        metrics.observe_first_token(now - s.arrival, engine)
                    else:
                        metrics.observe_inter_token(now - last_token_time, engine)
                    last_token_time = now
                if out.request_stats is not None:  # an engine request (a choice, with n > 1) ended
                    index = out.outputs[0].index if out.outputs else 0
                    metrics.observe_request_stats(out.request_stats, choice_tokens[index], engine)
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
            finished = FinishedRequest(
                time.perf_counter() - s.arrival,
                len(s.prompt_token_ids),
                num_cached_tokens,
                list(choice_tokens.values()),
                s.params.n,
                s.params.max_tokens,
            )
            metrics.observe_finished(finish_reason, finished, engine)


async def _whole(client, *args, **kwargs) -> AsyncIterator[RequestOutput]:
    """client.generate's answer as a stream of one output."""
    yield await client.generate(*args, **kwargs)


@dataclass
class PromptStream:
    """One prompt's engine outputs, the builder that answers them, and its token counts."""

    outputs: AsyncIterator[RequestOutput]
    builder: ResponseBuilder
    num_prompt_tokens: int
    choice_tokens: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    num_cached_tokens: int = 0

    def count(self, out: RequestOutput) -> None:
        """Take an output's tokens and cached-token count."""
        self.num_cached_tokens = out.num_cached_tokens
        for delta in out.outputs:
            self.choice_tokens[delta.index] += len(delta.token_ids)

    def usage(self, index: int | None = None) -> dict:
        """Its usage so far (of choice `index` alone: vLLM's continuous usage)."""
        tokens = self.choice_tokens
        num_tokens = sum(tokens.values()) if index is None else tokens[index]
        return self.builder.usage(self.num_prompt_tokens, num_tokens, self.num_cached_tokens)


async def complete(prompts: list[PromptStream], want_logprobs: bool) -> dict:
    """The whole response of a non-streaming request: each prompt's choices in turn."""
    responses = await gather_or_cancel([_complete(p, want_logprobs) for p in prompts])
    choices = [choice for response in responses for choice in response["choices"]]
    usage = _total([response["usage"] for response in responses])
    return {**responses[0], "choices": choices, "usage": usage}


async def _complete(prompt: PromptStream, want_logprobs: bool) -> dict:
    """One prompt's response: its choices' deltas joined."""
    texts: dict[int, list[str]] = defaultdict(list)
    token_ids: dict[int, list[int]] = defaultdict(list)
    logprobs: dict[int, list[dict[int, Logprob]]] = defaultdict(list)
    ends: dict[int, CompletionOutput] = {}  # each choice's last delta
    kv_transfer_params = None
    async with aclosing(prompt.outputs):
        async for out in prompt.outputs:
            kv_transfer_params = out.kv_transfer_params or kv_transfer_params
            prompt.builder.add_prompt_logprobs(out.prompt_logprobs)
            prompt.count(out)
            for delta in out.outputs:
                texts[delta.index].append(delta.text)
                token_ids[delta.index].extend(delta.token_ids)
                logprobs[delta.index].extend(delta.logprobs or ())
                ends[delta.index] = delta
    choices = [
        CompletionOutput(
            index,
            "".join(texts[index]),
            token_ids[index],
            ends[index].finish_reason,
            logprobs[index] if want_logprobs else None,
            ends[index].stop_reason,
        )
        for index in sorted(ends)
    ]
    response = prompt.builder.response(choices, prompt.usage())
    if kv_transfer_params is not None:  # a KV producer's, as vLLM answers it
        response["kv_transfer_params"] = kv_transfer_params
    return response


async def first_outputs(prompts: list[PromptStream]) -> list[RequestOutput | None]:
    """Each prompt's first output (so a request the engine rejects is an HTTP error before
    any chunk); if one fails, every prompt's outputs are closed (their requests aborted)."""
    try:
        return await gather_or_cancel([anext(p.outputs, None) for p in prompts])
    except BaseException:
        for prompt in prompts:
            await prompt.outputs.aclose()
        raise


async def event_stream(
    prompts: list[PromptStream],
    firsts: list[RequestOutput | None],
    want_logprobs: bool,
    include_usage: bool,
    continuous_usage: bool = False,
) -> AsyncIterator[str]:
    """Server-sent events of OpenAI chunks, each prompt's as they come (its first output,
    already taken from its outputs, first), then an optional usage chunk, then
    `data: [DONE]`; with `continuous_usage` (vLLM's) every chunk carries its prompt's and
    choice's usage so far. An error after the first chunk ends the chunks with an error
    event (then `data: [DONE]`)."""
    chunks = interleaved(
        [
            _chunks(prompt, first, want_logprobs, continuous_usage)
            for prompt, first in zip(prompts, firsts, strict=True)
        ]
    )
    async with aclosing(chunks):
        try:
            async for chunk in chunks:
                yield _event(chunk)
        except APIError as e:
            yield _event(e.body())
            include_usage = False
        except Exception:
            logger.exception("request %s failed while streaming", prompts[0].builder.request_id)
            yield _event(APIError(500, UNEXPECTED).body())
            include_usage = False
    if include_usage:
        usage = _total([prompt.usage() for prompt in prompts])
        yield _event(prompts[0].builder.usage_chunk(usage))
    yield "data: [DONE]\n\n"


async def _chunks(
    prompt: PromptStream,
    first: RequestOutput | None,
    want_logprobs: bool,
    continuous_usage: bool,
) -> AsyncIterator[dict]:
    """One prompt's chunks."""
    builder = prompt.builder
    async with aclosing(prompt.outputs):
        for chunk in builder.first_chunks():
            yield chunk
        out = first
        while out is not None:
            prompt.count(out)
            builder.add_prompt_logprobs(out.prompt_logprobs)
            for delta in out.outputs:
                logprobs = delta.logprobs if want_logprobs else None
                finished = delta.finish_reason is not None
                token_ids = delta.token_ids if builder.return_token_ids else ()
                if delta.text or logprobs or finished or token_ids:
                    end = (delta.finish_reason, delta.stop_reason) if finished else ()
                    chunk = builder.chunk(delta.index, delta.text, delta.token_ids, logprobs, *end)
                    if chunk is None:  # held back (a tool call may be starting)
                        continue
                    if continuous_usage:
                        chunk["usage"] = prompt.usage(delta.index)
                    yield chunk
            out = await anext(prompt.outputs, None)


def _total(usages: list[dict]) -> dict:
    """The usage of several prompts: their counts added up."""
    total = dict(usages[0])
    for usage in usages[1:]:
        for key, value in usage.items():
            if isinstance(value, dict):
                total[key] = {k: total[key][k] + v for k, v in value.items()}
            else:
                total[key] += value
    return total


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
