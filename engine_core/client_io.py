"""The EngineCore process's client sockets, each owned by one thread.

* input thread — the input ROUTER. Each client frame is decoded and put on
  `input_queue` tagged with the client's identity. A frame that does not decode is
  logged and answered with UtilityOutput(call_id=-1, error), or, when it is an
  EngineCoreRequest whose request_id can be read, with an "error" output for it.
* output thread — the output ROUTER. Answers HELLO with WELCOME; encodes and sends the
  (identity, message) pairs handed to `send_many`, never blocking. With
  ROUTER_MANDATORY a client that is gone is noticed on send. A client whose pipe is full
  (HWM frames not yet taken by ZeroMQ's I/O thread: a burst, or a client that stopped
  reading) gets a backlog, retried every few milliseconds; a client whose backlog makes
  no progress for `_STALL_S` or grows past `_MAX_BACKLOG` frames has stopped reading.
  A client gone or stopped is dropped (its outputs are discarded until it says HELLO
  again) and `ClientGone` on the input queue has the busy loop abort its requests.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from ipc.auth import CLIENT, Credentials, engine_context
from ipc.messages import (
    FROM_CLIENTS,
    DecodeError,
    Decoder,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ErrorCode,
    FinishReason,
    UtilityOutput,
    encode,
)
from ipc.sockets import HELLO, HWM, WELCOME, make_socket, socket_address

logger = logging.getLogger(__name__)

_POLL_MS = 100
_WAKE_ADDRESS = "inproc://output-wake"
_OUTPUT_LINGER_MS = 1000
_RETRY_MS = 5
_STALL_S = 5.0
_MAX_BACKLOG = 10 * HWM


class ClientGone:
    """Put on the input queue by the output thread: this client can no longer be reached."""


class ClientIO:
    """The input and output ROUTERs of `address` and their threads; a tcp `address`
    needs the cluster's `credentials` (ipc/auth.py)."""

    def __init__(self, address: str, credentials: Credentials | None = None) -> None:
        self.input_queue: queue.Queue = queue.Queue()
        self._output_queue: queue.Queue = queue.Queue()
        self._stopping = threading.Event()
        self._ctx = engine_context(credentials)
        secure = {"credentials": credentials, "role": CLIENT}
        self._input = make_socket(
            self._ctx, zmq.ROUTER, socket_address(address, "input"), True, **secure
        )
        self._output = make_socket(
            self._ctx, zmq.ROUTER, socket_address(address, "output"), True, **secure
        )
        self._output.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._wake = make_socket(self._ctx, zmq.PUSH, _WAKE_ADDRESS, True)
        self._threads = [
            threading.Thread(target=self._input_loop, name="engine-input", daemon=True),
            threading.Thread(target=self._output_loop, name="engine-output", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def send(self, identity: bytes, msg: msgspec.Struct) -> None:
        self.send_many([(identity, msg)])

    def send_many(self, items: list[tuple[bytes, msgspec.Struct]] | None) -> None:
        """Hand messages (None: stop) to the output thread; one wake-up per put."""
        self._output_queue.put(items)
        self._wake.send(b"")

    def close(self) -> None:
        """Send what is queued (for up to a second), then close the sockets."""
        self._stopping.set()
        self.send_many(None)
        for thread in self._threads:
            thread.join(timeout=5.0)
        self._wake.close()
        self._ctx.term()

    # input thread

    def _input_loop(self) -> None:
        decoder = Decoder(*FROM_CLIENTS)
        sock = self._input
        while not self._stopping.is_set():
            if not sock.poll(_POLL_MS):
                continue
            identity, *frames = sock.recv_multipart()
            try:
                msg = _decode(decoder, identity, frames)
            except Exception as e:  # never let one frame stop the input thread
                logger.exception("could not read a frame from client %s", identity.hex())
                msg = UtilityOutput(-1, error=f"could not read the frame: {e}")
            self.input_queue.put((identity, msg))
        sock.close()

    # output thread

    def _output_loop(self) -> None:
        sock = self._output
        wake = make_socket(self._ctx, zmq.PULL, _WAKE_ADDRESS, False)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        out = _Outbox(sock, self.input_queue)
        try:
            while True:
                events = dict(poller.poll(_RETRY_MS if out.backlogs else None))
                if sock in events:
                    identity, *frames = sock.recv_multipart()
                    if frames == [HELLO]:
                        out.gone.discard(identity)
                        out.deliver(identity, WELCOME)
                    else:
                        logger.warning("ignored a frame on the output socket (expected HELLO)")
                if wake in events:
                    wake.recv()
                    items = self._output_queue.get_nowait()
                    if items is None:
                        return
                    for identity, msg in items:
                        out.deliver(identity, encode(msg))
                out.retry()
        finally:
            wake.close()
            sock.close(linger=_OUTPUT_LINGER_MS)


class _Outbox:
    """The output ROUTER's sends, never blocking: a client's frames wait in its backlog
    while its pipe is full, in order, and later frames queue behind them."""

    def __init__(self, sock: zmq.Socket, input_queue: queue.Queue) -> None:
        self._sock = sock
        self._input_queue = input_queue
        self.gone: set[bytes] = set()
        self.backlogs: dict[bytes, deque[bytes]] = {}
        self._progress: dict[bytes, float] = {}  # when each backlog last shrank

    def deliver(self, identity: bytes, frame: bytes) -> None:
        if identity in self.gone:
            self._input_queue.put((identity, ClientGone))
            return
        backlog = self.backlogs.get(identity)
        if backlog is not None:
            backlog.append(frame)
            if len(backlog) > _MAX_BACKLOG:
                self._drop(identity, f"{len(backlog)} outputs waiting")
        elif not self._send(identity, frame):
            self.backlogs[identity] = deque([frame])
            self._progress[identity] = time.monotonic()

    def retry(self) -> None:
        now = time.monotonic()
        for identity, backlog in list(self.backlogs.items()):
            while backlog and self._send(identity, backlog[0]):
                backlog.popleft()
                self._progress[identity] = now
            if not backlog:
                del self.backlogs[identity], self._progress[identity]
            elif now - self._progress[identity] > _STALL_S:
                self._drop(identity, f"none taken for {_STALL_S:.0f} s")

    def _send(self, identity: bytes, frame: bytes) -> bool:
        """Whether ZeroMQ took the frame (False: the pipe is full); a client that is not
        connected is dropped."""
        if identity in self.gone:
            return True
        try:
            self._sock.send_multipart((identity, frame), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            logger.warning("client %s is not connected; dropped its output", identity.hex())
            self.gone.add(identity)
            self._input_queue.put((identity, ClientGone))
        return True

    def _drop(self, identity: bytes, why: str) -> None:
        logger.warning(
            "client %s stopped reading its outputs (%s); dropped it", identity.hex(), why
        )
        self.gone.add(identity)
        del self.backlogs[identity], self._progress[identity]
        self._input_queue.put((identity, ClientGone))


def _decode(decoder: Decoder, identity: bytes, frames: list[bytes]) -> object:
    """The client's message, or the answer to send back for a frame that is not one."""
    if len(frames) == 1:
        try:
            return decoder.decode(frames[0])
        except DecodeError as e:
            error = str(e)
    else:
        error = f"expected one frame per message, got {len(frames)}"
    logger.warning("bad frame from client %s: %s", identity.hex(), error)
    request_id = _request_id_of(frames[0]) if len(frames) == 1 else None
    if request_id is None:
        return UtilityOutput(-1, error=error)
    return error_outputs([request_id], error)


class _MessageHead(msgspec.Struct, array_like=True):
    """The first two fields of a tagged message (the rest is skipped)."""

    tag: str
    request_id: str


_head_decoder = Decoder(_MessageHead)


def _request_id_of(frame: bytes) -> str | None:
    """The request_id of a frame shaped like an EngineCoreRequest that failed validation."""
    try:
        head = _head_decoder.decode(frame)
    except DecodeError:
        return None
    return head.request_id if head.tag == EngineCoreRequest.__name__ else None


def error_outputs(
    request_ids: list[str], error: str, code: ErrorCode = ErrorCode.INVALID_REQUEST
) -> EngineCoreOutputs:
    return EngineCoreOutputs(
        [
            EngineCoreOutput(i, [], FinishReason.ERROR, error=error, error_code=code)
            for i in request_ids
        ]
    )
