"""What the sync and async clients hold alike: the engine's address and credentials and
the sans-IO ClientCore (which sends through the client's own `_send`)."""

from __future__ import annotations

import os

import msgspec

from ipc.auth import Credentials, client_credentials
from ipc.client.core import ClientCore
from ipc.sockets import read_address
from ipc.tokenizer import TokenizerLike


class ClientBase:
    """`address`: an engine address or a file holding one. `credentials` (a file or
    ipc.auth.Credentials) are needed on tcp; given an address file, the client reads
    FILE.credentials when it exists. `health_interval`: a request that hears nothing for
    this long asks the engine for its health, and raises EngineDeadError if that goes
    unanswered as long."""

    def __init__(
        self,
        address: str,
        tokenizer: str | os.PathLike | TokenizerLike | None,
        health_interval: float,
        credentials: Credentials | str | os.PathLike | None,
    ) -> None:
        self.address = read_address(address)
        self._credentials = client_credentials(address, self.address, credentials)
        self.health_interval = health_interval
        self._core = ClientCore(tokenizer, self.address, self._send)

    @property
    def tokenizer(self) -> TokenizerLike | None:
        return self._core.tokenizer

    def _send(self, message: msgspec.Struct) -> bool:
        """Send without blocking; False if the engine's queue is full."""
        raise NotImplementedError
