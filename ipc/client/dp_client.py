"""DataParallelClient: one asyncio client of several EngineCores (`--data-parallel-size`),
each request sent whole to one of them.

The engine chosen is the connected one with the least load, vLLM's measure: waiting x 4 +
running, from each engine's stats (asked for every LOAD_INTERVAL_S, so the requests that
other API servers send count too), plus the requests this client sent it since those
stats were taken, counted as waiting. An engine that is down (dead, restarting) gets no
new request; the requests it held fail with EngineDeadError, as with one engine, and the
client takes it back once it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ipc.auth import Credentials, client_credentials
from ipc.client.async_client import AsyncEngineClient
from ipc.client.errors import EngineDeadError
from ipc.client.input_processor import Prompt
from ipc.client.parallel_sampling import check_streamable
from ipc.messages import SchedulerStats
from ipc.outputs import RequestOutput
from ipc.sampling_params import SamplingParams
from ipc.sockets import read_address
from ipc.tokenizer import Message, TokenizerLike

LOAD_INTERVAL_S = 0.2
WAITING_WEIGHT = 4


class DataParallelClient:
    """`addresses`: one per engine, or a string: addresses separated by commas, or the
    file launch.py --address-file writes (its credentials beside it are picked up). The
    other arguments are AsyncEngineClient's, for each engine. Use `await
    DataParallelClient.create(addresses, ...)` or construct and `await connect()`."""

    def __init__(
        self,
        addresses: str | Sequence[str],
        credentials: Credentials | str | os.PathLike | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(addresses, str):
            given, addresses = addresses, read_address(addresses).split(",")
            credentials = client_credentials(given, addresses[0], credentials)
        if not addresses:
            raise ValueError("DataParallelClient needs at least one engine address")
        self.engines = [
            AsyncEngineClient(address, credentials=credentials, **kwargs) for address in addresses
        ]
        self._load = [0] * len(self.engines)  # from each engine's last stats
        self._sent = [0] * len(self.engines)  # requests sent since those stats
        self._engine_of: dict[str, int] = {}  # live requests
        self._poller: asyncio.Task | None = None

    @classmethod
    async def create(cls, addresses: str | Sequence[str], **kwargs: Any) -> DataParallelClient:
        client = cls(addresses, **kwargs)
        await client.connect()
        return client

    @property
    def tokenizer(self) -> TokenizerLike | None:
        return self.engines[0].tokenizer

    async def connect(self) -> None:
        """Connect to every engine (each must answer once), then follow their load. When
        one does not answer, raises its error: calling again connects the others."""
        waiting = [engine for engine in self.engines if not engine.connected]
        answers = await asyncio.gather(*(e.connect() for e in waiting), return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        self._poller = asyncio.create_task(self._poll_load())

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        """AsyncEngineClient.generate on the least loaded engine."""
        request_id = request_id or uuid.uuid4().hex
        index = self._choose()
        with self._live(request_id, index):
            return await self.engines[index].generate(
                prompt, sampling_params, request_id, priority, cache_salt
            )

    async def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """AsyncEngineClient.stream on the least loaded engine."""
        check_streamable(sampling_params)
        request_id = request_id or uuid.uuid4().hex
        index = self._choose()
        stream = self.engines[index].stream(
            prompt, sampling_params, request_id, priority, cache_salt
        )
        with self._live(request_id, index):
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    yield delta

    async def chat(
        self,
        messages: list[Message],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        **kwargs: Any,
    ) -> RequestOutput:
        request_id = request_id or uuid.uuid4().hex
        index = self._choose()
        with self._live(request_id, index):
            return await self.engines[index].chat(
                messages, sampling_params, request_id=request_id, **kwargs
            )

    def engine_index(self, request_id: str) -> int:
        """The engine a live request runs on (0 once it is not live)."""
        return self._engine_of.get(request_id, 0)

    async def abort(self, request_id: str) -> None:
        index = self._engine_of.get(request_id)
        if index is not None:
            await self.engines[index].abort(request_id)

    async def engine_stats(self, timeout: float = 30.0) -> list[SchedulerStats | None]:
        """Each engine's stats, None for one that does not answer."""
        answers = await asyncio.gather(
            *(engine.stats(timeout) for engine in self.engines), return_exceptions=True
        )
        return [a if isinstance(a, SchedulerStats) else None for a in answers]

    async def stats(self, timeout: float = 30.0) -> SchedulerStats:
        """The first engine's stats that answers (engine_stats has them all)."""
        for stats in await self.engine_stats(timeout):
            if stats is not None:
                return stats
        raise EngineDeadError("no EngineCore answered")

    async def reset_prefix_cache(self, timeout: float = 30.0) -> bool:
        done = await asyncio.gather(*(e.reset_prefix_cache(timeout) for e in self.engines))
        return all(done)

    async def health(self, timeout: float = 5.0) -> bool:
        """True while at least one engine serves."""
        answers = await asyncio.gather(
            *(engine.health(timeout) for engine in self.engines), return_exceptions=True
        )
        return any(a is True for a in answers)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        await asyncio.gather(*(engine.close() for engine in self.engines))

    async def __aenter__(self) -> DataParallelClient:
        if self._poller is None:
            await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _choose(self) -> int:
        """The connected engine with the least load (the first of equals), counted as
        one more waiting request there; EngineDeadError when none is connected."""
        up = [i for i, engine in enumerate(self.engines) if engine.connected]
        if not up:
            raise EngineDeadError("no EngineCore is connected")
        index = min(up, key=lambda i: self._load[i] + WAITING_WEIGHT * self._sent[i])
        self._sent[index] += 1
        return index

    @contextlib.contextmanager
    def _live(self, request_id: str, index: int):
        self._engine_of[request_id] = index
        try:
            yield
        finally:
            self._engine_of.pop(request_id, None)

    async def _poll_load(self) -> None:
        while True:
            await asyncio.sleep(LOAD_INTERVAL_S)
            sent = list(self._sent)
            for i, stats in enumerate(await self.engine_stats(timeout=LOAD_INTERVAL_S * 5)):
                if stats is not None:
                    self._load[i] = WAITING_WEIGHT * stats.num_waiting + stats.num_running
                    self._sent[i] -= sent[i]
