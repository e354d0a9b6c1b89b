"""What the sync and async clients share; they differ only in I/O.

`ClientCore` turns prompts into EngineCoreRequests and folds the engine's outputs into
RequestOutputs (incremental detokenization, stop strings), putting each request's
deltas into that request's queue (`queue.Queue` or `asyncio.Queue`: only `put_nowait`
is used), and matches utility answers to their futures. It owns no socket: it sends
through the `send` it is given, which never blocks. The waits both clients do (for a
request's next delta, a call's answer, WELCOME) are written once, in steps.py.

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
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from ipc.auth import CredentialsError
from ipc.bad_words import with_bad_words_token_ids
from ipc.client.parallel_sampling import ParentRequest, engine_states, is_parallel
from ipc.client.request_state import (
    Prompt,
    RequestState,
    Sink,
    chat_token_ids,
    load_tokenizer,
    prompt_text,
    prompt_token_ids,
)
from ipc.messages import (
    AbortRequests,
    DecodeError,
    Decoder,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ErrorCode,
    FinishReason,
    UtilityOutput,
    UtilityRequest,
)
from ipc.sampling_params import SamplingParams
from ipc.sockets import WELCOME
from ipc.tokenizer import Message, TokenizerLike

logger = logging.getLogger(__name__)

CLOSE_LINGER_MS = 1000  # how long a closing client lets its last aborts leave
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


class RequestError(ValueError):
    """The EngineCore refused or failed a request (finish_reason "error"); `code` says
    whether the request was at fault (INVALID_REQUEST) or the engine (INTERNAL,
    UNAVAILABLE)."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST) -> None:
        super().__init__(message)
        self.code = code


class EngineDeadError(RuntimeError):
    """The EngineCore did not answer in time, or the connection to it is lost."""


# Sends a message without blocking; False when the engine's queue is full.
Send = Callable[[msgspec.Struct], bool]


def new_identity() -> bytes:
    """8 random bytes for the client's DEALERs; ZMQ reserves identities starting with 0."""
    identity = os.urandom(8)
    return bytes([identity[0] | 1]) + identity[1:]


def _request_error(out: EngineCoreOutput) -> RequestError:
    return RequestError(out.error or "the EngineCore failed", out.error_code)


def full_queue_error(address: str) -> EngineDeadError:
    return EngineDeadError(f"the EngineCore at {address} is not reading (send queue full)")


class ClientCore:
    def __init__(
        self, tokenizer: str | os.PathLike | TokenizerLike | None, address: str, send: Send
    ) -> None:
        self.tokenizer = load_tokenizer(tokenizer)
        self.address = address
        self._send = send
        # Why requests cannot be sent now; None while connected and welcomed.
        self._down: Exception | None = EngineDeadError(
            f"not connected to the EngineCore at {address} yet"
        )
        # Live requests by the id the engine knows them by (children of parallel ones too).
        self._requests: dict[str, RequestState] = {}
        # Requests with n or best_of > 1, by their own id.
        self._parents: dict[str, ParentRequest] = {}
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        # Reentrant: a stream garbage-collected while this thread holds the lock
        # aborts its request from inside the collector.
        self._lock = threading.RLock()
        self._decoder = Decoder(EngineCoreOutputs, UtilityOutput)

    def prompt_token_ids(self, prompt: Prompt) -> list[int]:
        return prompt_token_ids(self.tokenizer, prompt)

    def chat_token_ids(self, messages: list[Message]) -> list[int]:
        return chat_token_ids(self.tokenizer, messages)

    def add_request(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None,
        request_id: str | None,
        priority: int,
        cache_salt: str | None,
        queue: Sink,
    ) -> RequestState | ParentRequest:
        params = with_bad_words_token_ids(sampling_params or SamplingParams(), self.tokenizer)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        request = EngineCoreRequest(
            request_id or uuid.uuid4().hex,
            self.prompt_token_ids(prompt),
            params,
            time.time(),
            priority,
            cache_salt,
        )
        text = prompt_text(prompt)
        kind = ParentRequest if is_parallel(params) else RequestState
        state = kind(request, self.tokenizer, queue, text)
        children = engine_states(state)
        with self._lock:
            self.check_connected()
            for request_id in {request.request_id, *(c.request.request_id for c in children)}:
                if request_id in self._requests or request_id in self._parents:
                    raise ValueError(f"request id {request_id!r} is already running")
            for child in children:
                self._requests[child.request.request_id] = child
            if state is not children[0]:
                self._parents[request.request_id] = state
        return state

    def submit(
        self,
        queue: Sink,
        prompt: Prompt,
        sampling_params: SamplingParams | None,
        request_id: str | None,
        priority: int,
        cache_salt: str | None,
    ) -> RequestState | ParentRequest:
        """add_request, then send it (each child of a parallel request); a request that
        cannot leave (a full queue, or a message the encoder refuses) is forgotten, and
        the children that left are aborted."""
        state = self.add_request(prompt, sampling_params, request_id, priority, cache_salt, queue)
        forget = self.release if isinstance(state, ParentRequest) else self.pop
        try:
            sent = all(self._send(child.request) for child in engine_states(state))
        except BaseException:
            forget(state.request.request_id)
            raise
        if not sent:
            forget(state.request.request_id)
            raise full_queue_error(self.address)
        return state

    def release(self, request_id: str) -> None:
        """Its consumer is done with a request: abort it in the engine if it is still live."""
        state = self.pop(request_id)
        if state is not None:
            self._send(AbortRequests([c.request.request_id for c in engine_states(state)]))

    def pop(self, request_id: str) -> RequestState | ParentRequest | None:
        """Forget a live request, with its children (None if it is not live; a child goes
        only with its parent)."""
        with self._lock:
            parent = self._parents.pop(request_id, None)
            if parent is not None:
                for child in parent.children:
                    self._requests.pop(child.request.request_id, None)
                return parent
            state = self._requests.get(request_id)
            if state is None or state.parent is not None:
                return None
            return self._requests.pop(request_id)

    def abort(self, request_id: str) -> bool:
        """Finish a live request with finish_reason "abort", waking its consumer, and abort
        it in the engine."""
        state = self.pop(request_id)
        if state is None:
            return False
        if isinstance(state, ParentRequest):
            state.queue.put_nowait(state.abort())
        else:
            state.queue.put_nowait(
                state.apply(EngineCoreOutput(request_id, [], FinishReason.ABORT))
            )
        self._send(AbortRequests([c.request.request_id for c in engine_states(state)]))
        return True

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
        stopped = []
        with self._lock:
            for out in outputs.outputs:
                state = self._requests.get(out.request_id)
                if state is None:
                    continue  # finished or aborted here; the engine has not caught up yet
                if state.parent is not None:
                    stopped += self._apply_child(state, out)
                    continue
                delta = state.apply(out)
                if not delta.finished:
                    state.queue.put_nowait(delta)
                    continue
                del self._requests[out.request_id]
                if out.finish_reason == FinishReason.ERROR:
                    state.queue.put_nowait(_request_error(out))
                    continue
                state.queue.put_nowait(delta)
                if state.stopped_by_string:
                    stopped.append(out.request_id)
        return stopped

    def _apply_child(self, child: RequestState, out: EngineCoreOutput) -> list[str]:
        """process_outputs for a child of a parallel request (the lock held): one failed
        child fails the parent, whose live children are then to be aborted."""
        parent = child.parent
        delta = parent.apply(child, out)
        if not child.result.finished:
            parent.queue.put_nowait(delta)
            return []
        del self._requests[out.request_id]
        if out.finish_reason == FinishReason.ERROR:
            self.pop(parent.request.request_id)
            parent.queue.put_nowait(_request_error(out))
            return parent.live_request_ids()
        if delta.finished:
            del self._parents[parent.request.request_id]
        parent.queue.put_nowait(delta)
        return [out.request_id] if child.stopped_by_string else []

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
            states, self._requests = self._requests, {}
            self._parents = {}
            calls, self._calls = self._calls, {}
        for queue in {id(state.queue): state.queue for state in states.values()}.values():
            while drop_unread and not queue.empty():
                queue.get_nowait()
            queue.put_nowait(error)
        for future in calls.values():
            if not future.done():
                future.set_exception(error)
        return list(states)

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
