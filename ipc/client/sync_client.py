"""EngineClient: a blocking, thread-safe client of an EngineCore process.

Sends go through one lock and never block; one background thread owns the output
socket and its monitor, and hands each request's deltas to that request's queue, utility
answers to their futures, and connection events to the ClientCore (a lost engine fails
every live request at once).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import zmq

import ipc.client.steps as steps
from ipc.client.base import CLOSE_LINGER_MS, ClientBase
from ipc.client.input_processor import Prompt
from ipc.client.output_processor import Handle
from ipc.client.parallel_sampling import check_streamable
from ipc.client.steps import Answer, NextItem, Step, Steps
from ipc.messages import SchedulerStats, encode
from ipc.outputs import RequestOutput
from ipc.sampling_params import SamplingParams
from ipc.sockets import HELLO
from ipc.tokenizer import Message


class EngineClient(ClientBase):
    """A blocking client, connected once constructed; the arguments are ClientBase's."""

    _new_queue = queue.SimpleQueue

    def _start(self) -> None:
        self._ctx = zmq.Context()
        self._open_sockets(self._ctx, self._ctx, zmq.Poller())
        self._send_lock = threading.RLock()
        try:
            self._output.send(HELLO)
            steps.run(steps.welcome(self._core, self.connect_timeout), self._wait)
        except BaseException:
            self._close_sockets()
            raise
        self._receiver = threading.Thread(target=self._receive_loop, daemon=True, name="client-rx")
        self._receiver.start()

    def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        """Run one request to the end; raises RequestError if the engine failed it."""
        handle = self._submit(prompt, sampling_params, request_id, priority, cache_salt)
        for _ in self._deltas(handle):
            pass
        return handle.result

    def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield one RequestOutput per engine output, holding only the new tokens and
        text (of the choices that changed, with n > 1). The request starts at the first
        next(); closing the iterator early aborts it. best_of > n cannot stream."""
        check_streamable(sampling_params)
        yield from self._deltas(
            self._submit(prompt, sampling_params, request_id, priority, cache_salt)
        )

    def chat(
        self, messages: list[Message], sampling_params: SamplingParams | None = None, **kwargs: Any
    ) -> RequestOutput:
        return self.generate(self._core.chat_token_ids(messages), sampling_params, **kwargs)

    def abort(self, request_id: str) -> None:
        """Stop a request; its generate returns (and its stream ends) with "abort"."""
        self._core.abort(request_id)

    def stats(self, timeout: float = 30.0) -> SchedulerStats:
        return self._call(steps.call(self._core, "stats", timeout))

    def reset_prefix_cache(self, timeout: float = 30.0) -> bool:
        return self._call(steps.call(self._core, "reset_prefix_cache", timeout))

    def health(self, timeout: float = 5.0) -> bool:
        return self._call(steps.health(self._core, timeout))

    def close(self) -> None:
        """Abort this client's live requests in the engine and release the sockets."""
        if self._closed:
            return
        self._core.abort_all(RuntimeError("the EngineClient was closed"))
        with self._send_lock:
            self._closed = True
            self._input.close(linger=CLOSE_LINGER_MS)
        self._ctx.term()  # wakes the receiver, which closes the output socket
        self._receiver.join()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _deltas(self, handle: Handle) -> Iterator[RequestOutput]:
        try:
            while True:
                delta = steps.run(
                    steps.next_delta(self._core, handle, self.health_interval), self._wait
                )
                yield delta
                if delta.finished:
                    return
        finally:
            self._core.release(handle.request.request_id)

    def _call(self, call: Steps[Any]) -> Any:
        self._check_open()
        return steps.run(call, self._wait)

    def _wait(self, step: Step) -> Any:
        if isinstance(step, NextItem):
            try:
                return step.queue.get(timeout=step.timeout)
            except queue.Empty:
                return None
        if isinstance(step, Answer):
            concurrent.futures.wait([step.future], step.timeout)
            return step.future.done()
        self._receive(step.timeout_ms)
        return None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the EngineClient is closed")

    def _send(self, message: msgspec.Struct) -> bool:
        """Send without blocking; False if the engine's queue is full. Once closed, drop
        it (close() failed every live request)."""
        frame = encode(message)
        with self._send_lock:
            if self._closed:
                return True
            try:
                self._input.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                return False
            return True

    def _receive(self, timeout_ms: int | None) -> None:
        """Handle what the output socket and its monitor hold, waiting up to timeout_ms.
        Frames first: those the engine sent before it went are in before the event."""
        events = dict(self._poller.poll(timeout_ms))
        if self._output in events:
            self._core.handle_frame(self._output.recv())
        if self._monitor not in events:
            return
        while self._output.poll(0):
            self._core.handle_frame(self._output.recv())
        if self._core.handle_event(self._monitor.recv_multipart()):
            self._output.send(HELLO, zmq.NOBLOCK)

    def _receive_loop(self) -> None:
        with self._output, self._monitor:
            try:
                while True:
                    self._receive(None)
            except zmq.ContextTerminated:
                pass  # close() was called
            except Exception as e:
                self._core.fail_all(RuntimeError(f"the EngineClient's receiver failed: {e!r}"))
                raise
