"""A scripted stand-in for the EngineCore process, speaking the client protocol.

    with FakeEngine() as engine:
        client = EngineClient(engine.address)

It binds the input and output ROUTERs of a fresh ipc:// address in a thread, answers
HELLO with WELCOME, and runs each request for `reply(request)` tokens (default: the
prompt repeated up to max_tokens), one token per step, round robin over the live
requests, each client's outputs of a step in one EngineCoreOutputs; the last token
comes with finish_reason "length". A prompt starting with FAIL_TOKEN is refused with
finish_reason "error". Aborts stop a request; utility calls are answered unless
`answer_utilities` is False; a `frozen` engine answers nothing at all. On a tcp `address`
it needs `credentials` (ipc/auth.py), as the real engine does.

`python tests/ipc/client_fakes.py ADDRESS [STEP_DELAY]` runs one as a process (to be
killed), with the repository root on PYTHONPATH.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import queue
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import zmq

from ipc.auth import CLIENT, Credentials, engine_context
from ipc.messages import (
    FROM_CLIENTS,
    AbortRequests,
    Decoder,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
    UtilityOutput,
    UtilityRequest,
    encode,
)
from ipc.sockets import (
    HELLO,
    WELCOME,
    make_socket,
    new_ipc_address,
    remove_ipc_files,
    socket_address,
)

FAIL_TOKEN = 999_999
FAIL_MESSAGE = "prompt too long: 3 tokens > max_model_len 2"


def echo(request: EngineCoreRequest) -> list[int]:
    n = request.sampling_params.max_tokens or len(request.prompt_token_ids)
    return list(itertools.islice(itertools.cycle(request.prompt_token_ids), n))


@functools.cache
def tiny_tokenizer_path() -> str:
    """The byte-level tokenizer of tests/models/tiny.py (ids 0-255 are the bytes),
    made once per test session."""
    from tests.models.tiny import make_tiny_tokenizer

    path = tempfile.mkdtemp(prefix="tiny-tokenizer-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    make_tiny_tokenizer(path)
    return path


class FakeEngine:
    def __init__(
        self,
        reply: Callable[[EngineCoreRequest], list[int]] = echo,
        step_delay: float = 0.0005,
        address: str | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        self.address = address or new_ipc_address()
        self.credentials = credentials
        self.reply = reply
        self.step_delay = step_delay
        self.requests: list[EngineCoreRequest] = []
        self.aborted: list[str] = []
        self.utility_calls: list[str] = []
        self.clients: set[bytes] = set()
        self.answer_utilities = True
        self.frozen = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, tuple[bytes, list[int]]] = {}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-engine")

    def __enter__(self) -> FakeEngine:
        self._thread.start()
        self._ready.wait()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        remove_ipc_files(self.address)

    def broadcast(self, message: EngineCoreOutputs | UtilityOutput) -> None:
        """Send a message to every client that said HELLO."""
        self._outbox.put(message)

    def wait_for(self, condition: Callable[[], bool], timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def _run(self) -> None:
        ctx = engine_context(self.credentials)
        keys = {"credentials": self.credentials, "role": CLIENT}
        inputs, outputs = (
            make_socket(ctx, zmq.ROUTER, socket_address(self.address, name), True, **keys)
            for name in ("input", "output")
        )
        poller = zmq.Poller()
        poller.register(inputs, zmq.POLLIN)
        poller.register(outputs, zmq.POLLIN)
        decoder = Decoder(*FROM_CLIENTS)
        self._ready.set()
        while not self._stop.is_set():
            events = dict(poller.poll(1 if self._live else 10))
            if outputs in events:
                identity, frame = outputs.recv_multipart()
                if frame == HELLO and not self.frozen:
                    self.clients.add(identity)
                    outputs.send_multipart([identity, WELCOME])
            while inputs.poll(0):
                identity, frame = inputs.recv_multipart()
                self._handle(identity, decoder.decode(frame), outputs)
            if self.frozen:
                continue
            while not self._outbox.empty():
                frame = encode(self._outbox.get())
                for identity in self.clients:
                    outputs.send_multipart([identity, frame])
            self._step(outputs)
            time.sleep(self.step_delay)
        inputs.close()
        outputs.close()
        ctx.term()

    def _handle(self, identity: bytes, message, outputs: zmq.Socket) -> None:
        if isinstance(message, EngineCoreRequest):
            self.requests.append(message)
            if message.prompt_token_ids[:1] == [FAIL_TOKEN]:
                error = EngineCoreOutput(
                    message.request_id, [], FinishReason.ERROR, error=FAIL_MESSAGE
                )
                outputs.send_multipart([identity, encode(EngineCoreOutputs([error]))])
            else:
                self._live[message.request_id] = (identity, self.reply(message))
        elif isinstance(message, AbortRequests):
            self.aborted.extend(message.request_ids)
            for request_id in message.request_ids:
                self._live.pop(request_id, None)
        else:
            self.utility_calls.append(message.method)
            if self.answer_utilities and not self.frozen:
                answer = self._utility(message)
                outputs.send_multipart([identity, encode(answer)])

    def _utility(self, call: UtilityRequest) -> UtilityOutput:
        if call.method == "stats":
            return UtilityOutput(call.call_id, SchedulerStats(num_running=len(self._live)))
        if call.method in ("health", "reset_prefix_cache"):
            return UtilityOutput(call.call_id, True)
        return UtilityOutput(call.call_id, error=f"unknown method {call.method!r}")

    def _step(self, outputs: zmq.Socket) -> None:
        by_client: dict[bytes, list[EngineCoreOutput]] = defaultdict(list)
        for request_id, (identity, tokens) in list(self._live.items()):
            token = tokens.pop(0)
            finish_reason = None if tokens else FinishReason.LENGTH
            by_client[identity].append(EngineCoreOutput(request_id, [token], finish_reason))
            if not tokens:
                del self._live[request_id]
        for identity, outs in by_client.items():
            outputs.send_multipart([identity, encode(EngineCoreOutputs(outs))])


if __name__ == "__main__":
    step_delay = float(sys.argv[2]) if len(sys.argv) > 2 else 0.01
    with FakeEngine(address=sys.argv[1], step_delay=step_delay):
        print("ready", flush=True)
        threading.Event().wait()
