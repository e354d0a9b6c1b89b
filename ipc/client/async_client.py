"""AsyncEngineClient: the asyncio client of an EngineCore process (the HTTP server's).

One task owns the output socket and its monitor, and hands each request's deltas to
that request's asyncio.Queue and connection events to the ClientCore (a lost engine
fails every live request at once). Sends go through a plain (blocking-API) socket on the
same ZMQ context, never waiting (a full queue fails the request), so an abort can be
sent from a `finally` of a cancelled task or a collected async generator.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

import ipc.client.steps as steps
from ipc.client.base import ClientBase
from ipc.client.errors import EngineDeadError
from ipc.client.input_processor import Prompt
from ipc.client.output_processor import Handle
from ipc.client.parallel_sampling import check_streamable
from ipc.client.steps import Answer, NextItem, Step, Steps
from ipc.messages import SchedulerStats, encode
from ipc.outputs import RequestOutput
from ipc.sampling_params import SamplingParams
from ipc.sockets import HELLO
from ipc.tokenizer import Message


class AsyncEngineClient(ClientBase):
    """Use `await AsyncEngineClient.create(address, ...)`, or construct and
    `await connect()`; the arguments are ClientBase's."""

    _new_queue = asyncio.Queue

    def _start(self) -> None:
        self._ctx: zmq.asyncio.Context | None = None
        self._receiver: asyncio.Task | None = None

    @classmethod
    async def create(cls, address: str, **kwargs: Any) -> AsyncEngineClient:
        client = cls(address, **kwargs)
        await client.connect()
        return client

    async def connect(self) -> None:
        if self._ctx is not None:
            raise RuntimeError("the AsyncEngineClient is already connected")
        self._ctx = zmq.asyncio.Context()
        self._open_sockets(
            zmq.Context.shadow(self._ctx.underlying), self._ctx, zmq.asyncio.Poller()
        )
        try:
            await self._output.send(HELLO)
            await steps.run_async(steps.welcome(self._core, self.connect_timeout), self._wait)
        except BaseException:
            self._close_sockets()
            self._ctx = None
            raise
        self._receiver = asyncio.create_task(self._receive_loop())

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        """Run one request to the end; raises RequestError if the engine failed it.
        Cancelling the caller aborts the request."""
        handle = self._submit(prompt, sampling_params, request_id, priority, cache_salt)
        async for _ in self._deltas(handle):
            pass
        return handle.result

    async def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield one RequestOutput per engine output, holding only the new tokens and
        text (of the choices that changed, with n > 1). Cancelling the consumer or closing
        the iterator early aborts the request. best_of > n cannot stream."""
        check_streamable(sampling_params)
        handle = self._submit(prompt, sampling_params, request_id, priority, cache_salt)
        async for delta in self._deltas(handle):
            yield delta

    async def chat(
        self, messages: list[Message], sampling_params: SamplingParams | None = None, **kwargs: Any
    ) -> RequestOutput:
        return await self.generate(self._core.chat_token_ids(messages), sampling_params, **kwargs)

    async def abort(self, request_id: str) -> None:
        """Stop a request; its generate returns (and its stream ends) with "abort"."""
        self._core.abort(request_id)

    async def stats(self, timeout: float = 30.0) -> SchedulerStats:
        return await self._call(steps.call(self._core, "stats", timeout))

    async def engine_stats(self, timeout: float = 30.0) -> list[SchedulerStats | None]:
        """[stats], or [None] when the engine does not answer (DataParallelClient's
        engine_stats has one per engine)."""
        try:
            return [await self.stats(timeout)]
        except EngineDeadError:
            return [None]

    def engine_index(self, request_id: str) -> int:
        """The data-parallel engine a request runs on: this client has one, 0."""
        return 0

    async def reset_prefix_cache(self, timeout: float = 30.0) -> bool:
        return await self._call(steps.call(self._core, "reset_prefix_cache", timeout))

    async def health(self, timeout: float = 5.0) -> bool:
        return await self._call(steps.health(self._core, timeout))

    async def close(self) -> None:
        """Abort this client's live requests in the engine and release the sockets."""
        if self._closed or self._receiver is None:
            return
        self._core.abort_all(RuntimeError("the AsyncEngineClient was closed"))
        self._closed = True
        self._receiver.cancel()
        await asyncio.wait([self._receiver])
        self._close_sockets()

    async def __aenter__(self) -> AsyncEngineClient:
        if self._receiver is None:
            await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _deltas(self, handle: Handle) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                delta = await steps.run_async(
                    steps.next_delta(self._core, handle, self.health_interval), self._wait
                )
                yield delta
                if delta.finished:
                    return
        finally:
            self._core.release(handle.request.request_id)

    async def _call(self, call: Steps[Any]) -> Any:
        self._check_open()
        return await steps.run_async(call, self._wait)

    async def _wait(self, step: Step) -> Any:
        if isinstance(step, NextItem):
            return await _get(step.queue, step.timeout)
        if isinstance(step, Answer):
            await asyncio.wait([asyncio.wrap_future(step.future)], timeout=step.timeout)
            return step.future.done()
        await self._receive(step.timeout_ms)
        return None

    def _check_open(self) -> None:
        if self._receiver is None:
            raise RuntimeError("the AsyncEngineClient is not connected: await connect() first")
        if self._closed:
            raise RuntimeError("the AsyncEngineClient is closed")

    def _send(self, message: msgspec.Struct) -> bool:
        """Send without waiting; False if the engine's queue is full. Once closed, drop
        it (close() failed every live request)."""
        if self._closed:
            return True
        try:
            self._input.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    async def _receive(self, timeout_ms: int | None) -> None:
        """Handle what the output socket and its monitor hold, waiting up to timeout_ms.
        Frames first: those the engine sent before it went are in before the event."""
        events = dict(await self._poller.poll(timeout_ms))
        if self._output in events:
            self._core.handle_frame(await self._output.recv())
        if self._monitor not in events:
            return
        while await self._output.poll(0):
            self._core.handle_frame(await self._output.recv())
        if self._core.handle_event(await self._monitor.recv_multipart()):
            await self._output.send(HELLO)

    async def _receive_loop(self) -> None:
        try:
            while True:
                await self._receive(None)
        except Exception as e:
            self._core.fail_all(RuntimeError(f"the AsyncEngineClient's receiver failed: {e!r}"))
            raise


async def _get(queue: asyncio.Queue, timeout: float) -> Any:
    """The next item of `queue`, or None after `timeout`. Unlike asyncio.wait_for
    before Python 3.12, never swallows a cancellation that races with an item."""
    if not queue.empty():
        return queue.get_nowait()
    getter = asyncio.ensure_future(queue.get())
    try:
        await asyncio.wait([getter], timeout=timeout)
    finally:
        getter.cancel()
    return getter.result() if getter.done() and not getter.cancelled() else None
