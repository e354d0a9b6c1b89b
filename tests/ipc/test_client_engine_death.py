"""A killed EngineCore: both clients fail in-flight requests with EngineDeadError within
a couple of seconds (not after the health check's silence), fail new ones at once while
the engine is gone, and serve again once an engine is back at the address.

The engine is the stand-in of client_fakes.py run as its own process, killed with
SIGKILL: no goodbye reaches the client, only the closed connection.
"""

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ipc.client import AsyncEngineClient, EngineClient, EngineDeadError
from ipc.messages import SamplingParams
from ipc.sockets import new_ipc_address, remove_ipc_files

ROOT = Path(__file__).resolve().parents[2]
FAKE = str(Path(__file__).with_name("client_fakes.py"))
HEALTH_INTERVAL = 5.0  # the old way to notice a dead engine took 2 of these
NOTICE_S = 2.5
LONG = SamplingParams(max_tokens=100_000)


class EngineProcess:
    def __init__(self, address: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.process = subprocess.Popen(
            [sys.executable, FAKE, address], stdout=subprocess.PIPE, env=env, text=True
        )
        assert self.process.stdout.readline() == "ready\n"

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
def address():
    address = new_ipc_address()
    engines = []

    def start() -> EngineProcess:
        engines.append(EngineProcess(address))
        return engines[-1]

    yield address, start
    for engine in engines:
        engine.kill()
    remove_ipc_files(address)


def test_sync_client_learns_of_a_killed_engine_at_once_and_reconnects(address):
    address, start = address
    engine = start()
    with EngineClient(address, health_interval=HEALTH_INTERVAL) as client:
        stream = client.stream([1, 2, 3], LONG)
        assert next(stream).outputs[0].token_ids == [1]
        engine.kill()
        start_time = time.monotonic()
        with pytest.raises(EngineDeadError, match="lost the connection"):
            for _ in stream:
                pass
        assert time.monotonic() - start_time < NOTICE_S

        start_time = time.monotonic()
        with pytest.raises(EngineDeadError):
            client.generate([4], SamplingParams(max_tokens=2))
        assert client.health() is False
        assert time.monotonic() - start_time < 0.5

        start()
        assert _eventually(lambda: client.generate([4], SamplingParams(max_tokens=2)))
        assert client.generate([5], SamplingParams(max_tokens=3)).outputs[0].token_ids == [5] * 3


def test_async_client_learns_of_a_killed_engine_at_once_and_reconnects(address):
    address, start = address
    engine = start()

    async def main():
        async with AsyncEngineClient(address, health_interval=HEALTH_INTERVAL) as client:
            task = asyncio.create_task(client.generate([1, 2, 3], LONG))
            stats = await client.stats()
            while stats.num_running == 0:
                stats = await client.stats()
            engine.kill()
            start_time = time.monotonic()
            with pytest.raises(EngineDeadError, match="lost the connection"):
                await task
            assert time.monotonic() - start_time < NOTICE_S

            start_time = time.monotonic()
            with pytest.raises(EngineDeadError):
                await client.generate([4], SamplingParams(max_tokens=2))
            assert await client.health() is False
            assert time.monotonic() - start_time < 0.5

            start()
            deadline = time.monotonic() + 10
            while True:
                try:
                    out = await client.generate([5], SamplingParams(max_tokens=3))
                    break
                except EngineDeadError:
                    assert time.monotonic() < deadline, "no reconnection"
                    await asyncio.sleep(0.05)
            assert out.outputs[0].token_ids == [5] * 3

    asyncio.run(main())


def _eventually(call, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except EngineDeadError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
