"""What the sync and async clients hold and do alike: the engine's address and
credentials, the sans-IO ClientCore (which sends through the client's own `_send`), the
sockets, and how a request is submitted."""

from __future__ import annotations

import os
from collections.abc import Callable

import msgspec
import zmq

from ipc.auth import Credentials, client_credentials
from ipc.client.core import MONITOR_EVENTS, ClientCore
from ipc.client.output_processor import Handle
from ipc.client.request_state import Sink
from ipc.sockets import client_sockets, read_address
from ipc.tokenizer import TokenizerLike

CLOSE_LINGER_MS = 1000  # how long a closing client lets its last aborts leave


def new_identity() -> bytes:
    """8 random bytes for the client's DEALERs; ZMQ reserves identities starting with 0."""
    identity = os.urandom(8)
    return bytes([identity[0] | 1]) + identity[1:]


class ClientBase:
    """`address`: an engine address or a file holding one. `credentials` (a file or
    ipc.auth.Credentials) are needed on tcp; given an address file, the client reads
    FILE.credentials when it exists. `connect_timeout` bounds the wait for the engine's
    WELCOME. `health_interval`: a request that hears nothing for this long asks the
    engine for its health, and raises EngineDeadError if that goes unanswered as long."""

    # Makes the queue a request's deltas go to.
    _new_queue: Callable[[], Sink]

    def __init__(
        self,
        address: str,
        tokenizer: str | os.PathLike | TokenizerLike | None = None,
        connect_timeout: float = 30.0,
        health_interval: float = 15.0,
        credentials: Credentials | str | os.PathLike | None = None,
    ) -> None:
        self.address = read_address(address)
        if "," in self.address:
            raise ValueError(
                f"{address} names several data-parallel engines ({self.address}): connect to "
                "them with DataParallelClient, or to one of them"
            )
        self._credentials = client_credentials(address, self.address, credentials)
        self.connect_timeout = connect_timeout
        self.health_interval = health_interval
        self._core = ClientCore(tokenizer, self.address, self._send)
        self._closed = False
        self._start()

    @property
    def tokenizer(self) -> TokenizerLike | None:
        return self._core.tokenizer

    @property
    def connected(self) -> bool:
        """Whether the engine answered and has not been lost since."""
        return self._core.connected

    def _start(self) -> None:
        """The client's own setup, last in __init__ (EngineClient connects here)."""
        raise NotImplementedError

    def _submit(self, prompt, sampling_params, request_id, priority, cache_salt) -> Handle:
        self._check_open()
        return self._core.submit(
            self._new_queue(), prompt, sampling_params, request_id, priority, cache_salt
        )

    def _open_sockets(
        self, input_ctx: zmq.Context, output_ctx: zmq.Context, poller: zmq.Poller
    ) -> None:
        """The input and output DEALERs, the output's monitor, and `poller` watching
        those two."""
        self._input, self._output = client_sockets(
            input_ctx, output_ctx, self.address, new_identity(), self._credentials, MONITOR_EVENTS
        )
        self._monitor = self._output.get_monitor_socket()
        self._poller = poller
        poller.register(self._output, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)

    def _close_sockets(self) -> None:
        """Close the sockets and terminate the client's context (`_ctx`)."""
        self._input.close(linger=CLOSE_LINGER_MS)
        self._output.close()
        self._monitor.close()
        self._ctx.term()

    def _check_open(self) -> None:
        raise NotImplementedError

    def _send(self, message: msgspec.Struct) -> bool:
        """Send without blocking; False if the engine's queue is full."""
        raise NotImplementedError
