"""What the sync and async clients share; they differ only in I/O.

`ClientCore` sends requests and matches what the engine sends back: the InputProcessor
turns prompts into EngineCoreRequests, the OutputProcessor folds the engine's outputs
into RequestOutputs and puts each request's deltas into that request's queue
(`queue.Queue` or `asyncio.Queue`: only `put_nowait` is used to deliver), and utility
answers go to their futures. It owns no socket: it sends through the `send` it is given,
which never blocks. The waits both clients do (for a request's next delta, a call's
answer, WELCOME) are written once, in steps.py.

It also keeps the state of the connection, fed with the frames of the output socket
and of that socket's monitor: a lost connection fails every live request and call with
EngineDeadError at once, and new ones fail at once until the engine is back (a fresh
connection, HELLO, WELCOME); a refused security handshake does the same with
CredentialsError. A hung engine that keeps its connection is found by the clients'
health checks instead.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from ipc.auth import CredentialsError
from ipc.client.errors import EngineDeadError
from ipc.client.input_processor import InputProcessor, Prompt, load_tokenizer
from ipc.client.output_processor import Handle, OutputProcessor, engine_states
from ipc.client.parallel_sampling import ParentRequest
from ipc.client.request_state import Sink
from ipc.messages import (
    TO_CLIENTS,
    AbortRequests,
    DecodeError,
    Decoder,
    EngineCoreOutputs,
    UtilityOutput,
    UtilityRequest,
)
from ipc.sampling_params import SamplingParams
from ipc.sockets import WELCOME
from ipc.tokenizer import Message, TokenizerLike

logger = logging.getLogger(__name__)

_REFUSED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the EngineCore at {} refused this client's credentials",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the EngineCore at {} refused the security handshake "
    "(tcp needs CURVE credentials, ipc none)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the security handshake with the EngineCore at {} "
    "failed: are the credentials this engine's?",
}
# What the output socket's monitor must report (make_socket's `monitor`).
MONITOR_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


# Sends a message without blocking; False when the engine's queue is full.
Send = Callable[[msgspec.Struct], bool]


def full_queue_error(address: str) -> EngineDeadError:
    return EngineDeadError(f"the EngineCore at {address} is not reading (send queue full)")


class ClientCore:
    def __init__(
        self, tokenizer: str | os.PathLike | TokenizerLike | None, address: str, send: Send
    ) -> None:
        tokenizer = load_tokenizer(tokenizer)
        self.input_processor = InputProcessor(tokenizer)
        self.output_processor = OutputProcessor(tokenizer)
        self.address = address
        self._send = send
        # Why requests cannot be sent now; None while connected and welcomed.
        self._down: Exception | None = EngineDeadError(
            f"not connected to the EngineCore at {address} yet"
        )
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        # Guards the output processor and the calls. Reentrant: a stream
        # garbage-collected while this thread holds the lock aborts its request from
        # inside the collector.
        self._lock = threading.RLock()
        self._decoder = Decoder(*TO_CLIENTS)

    @property
    def tokenizer(self) -> TokenizerLike | None:
        return self.input_processor.tokenizer

    def chat_token_ids(self, messages: list[Message]) -> list[int]:
        return self.input_processor.chat_token_ids(messages)

    def submit(
        self,
        queue: Sink,
        prompt: Prompt,
        sampling_params: SamplingParams | None,
        request_id: str | None,
        priority: int,
        cache_salt: str | None,
    ) -> Handle:
        """Track a request, then send it (each child of a parallel request); a request
        that cannot leave (a full queue, or a message the encoder refuses) is forgotten,
        and the children that left are aborted."""
        request, text = self.input_processor.process(
            prompt,
            sampling_params or SamplingParams(),
            request_id or uuid.uuid4().hex,
            priority,
            cache_salt,
        )
        with self._lock:
            self.check_connected()
            handle = self.output_processor.add_request(request, text, queue)
        forget = self.release if isinstance(handle, ParentRequest) else self.pop
        try:
            sent = all(self._send(state.request) for state in engine_states(handle))
        except BaseException:
            forget(request.request_id)
            raise
        if not sent:
            forget(request.request_id)
            raise full_queue_error(self.address)
        return handle

    def release(self, request_id: str) -> None:
        """Its consumer is done with a request: abort it in the engine if it is still live."""
        handle = self.pop(request_id)
        if handle is not None:
            self._send(AbortRequests([s.request.request_id for s in engine_states(handle)]))

    def pop(self, request_id: str) -> Handle | None:
        with self._lock:
            return self.output_processor.pop(request_id)

    def abort(self, request_id: str) -> bool:
        """Finish a live request with finish_reason "abort", waking its consumer, and abort
        it in the engine."""
        with self._lock:
            request_ids = self.output_processor.abort(request_id)
        if request_ids:
            self._send(AbortRequests(request_ids))
        return bool(request_ids)

    @property
    def connected(self) -> bool:
        return self._down is None

    def connection_error(self) -> Exception | None:
        """Why nothing can be sent now (a fresh exception), or None."""
        down = self._down
        return None if down is None else type(down)(str(down))

    def check_connected(self) -> None:
        error = self.connection_error()
        if error is not None:
            raise error

    def handle_event(self, frames: list[bytes]) -> bool:
        """Take one message of the output socket's monitor; True when a connection just
        opened and the caller must send HELLO on it."""
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return True
        if event in _REFUSED:
            self._lose(CredentialsError(_REFUSED[event].format(self.address)))
        elif event == zmq.EVENT_DISCONNECTED:
            self._lose(EngineDeadError(f"lost the connection to the EngineCore at {self.address}"))
        return False

    def _lose(self, error: Exception) -> None:
        with self._lock:
            if isinstance(self._down, CredentialsError) and isinstance(error, EngineDeadError):
                return  # the disconnection that follows a refused handshake
            self._down = error
        self.fail_all(error)

    def handle_frame(self, frame: bytes) -> None:
        """Deliver one frame from the engine's output socket; abort in the engine the
        requests whose text reached a stop string."""
        if frame == WELCOME:
            with self._lock:
                self._down = None
            return
        try:
            message = self._decoder.decode(frame)
        except DecodeError as e:
            logger.error("dropped a frame from the EngineCore: %s", e)
            return
        if isinstance(message, UtilityOutput):
            self.resolve_call(message)
            return
        stopped = self.process_outputs(message)
        if stopped:
            self._send(AbortRequests(stopped))

    def process_outputs(self, outputs: EngineCoreOutputs) -> list[str]:
        """Deliver the engine's outputs; return the requests the caller must abort in the
        engine: those that hit a stop string, and the siblings of a failed child."""
        with self._lock:
            return self.output_processor.process_outputs(outputs).reqs_to_abort

    def abort_all(self, error: Exception) -> None:
        """The client is closing: fail every live request and call with `error` (outputs
        received but not yet read are dropped: a closed client yields nothing more), and
        abort the requests in the engine."""
        live = self.fail_all(error, drop_unread=True)
        if live:
            self._send(AbortRequests(live))

    def fail_all(self, error: Exception, drop_unread: bool = False) -> list[str]:
        """Fail every live request and utility call; return the request ids that were
        live. With `drop_unread`, outputs still queued for a request go before the error."""
        with self._lock:
            live = self.output_processor.fail_all(error, drop_unread)
            calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(error)
        return live

    def add_call(self, method: str, future: Future) -> UtilityRequest:
        with self._lock:
            self.check_connected()
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        return UtilityRequest(call_id, method)

    def start_call(self, method: str, future: Future) -> int:
        """add_call, then send it; returns the call id (drop_call it when done)."""
        request = self.add_call(method, future)
        if not self._send(request):
            self.drop_call(request.call_id)
            raise full_queue_error(self.address)
        return request.call_id

    def drop_call(self, call_id: int) -> None:
        with self._lock:
            self._calls.pop(call_id, None)

    def resolve_call(self, out: UtilityOutput) -> None:
        if out.call_id == -1:
            logger.error("the EngineCore could not decode a frame from this client: %s", out.error)
            return
        with self._lock:
            future = self._calls.pop(out.call_id, None)
        if future is None or future.done():
            return  # its caller timed out
        if out.error is not None:
            future.set_exception(RuntimeError(f"EngineCore utility call failed: {out.error}"))
        else:
            future.set_result(out.result)
