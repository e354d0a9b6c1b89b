"""A killed EngineCore: both clients fail in-flight requests with EngineDeadError within
a couple of seconds (not after the health check's silence), fail new ones at once while
the engine is gone, and serve again once an engine is back at the address.

The engine is the stand-in of client_fakes.py run as its own process, killed with
SIGKILL: no goodbye reaches the client, only the closed connection. Last, an engine that
stays connected but stops reading: the client's bounded queue fills and fails requests.
"""

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

import ipc.sockets
from ipc.client import AsyncEngineClient, EngineClient, EngineDeadError
from ipc.sampling_params import SamplingParams
from ipc.sockets import WELCOME, make_socket, new_ipc_address, remove_ipc_files, socket_address

ROOT = Path(__file__).resolve().parents[2]
FAKE = str(Path(__file__).with_name("client_fakes.py"))
HEALTH_INTERVAL = 5.0  # the old way to notice a dead engine took 2 of these
NOTICE_S = 2.5
LONG = SamplingParams(max_tokens=100_000)


class EngineProcess:
    def __init__(self, address: str) -> None:
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONPATH=path)
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


def test_an_engine_that_stops_reading_fails_requests_instead_of_growing_the_client(
    monkeypatch,
):
    """An engine that is connected but never reads its input: once the client's bounded
    queue is full, a new request fails at once."""
    monkeypatch.setattr(ipc.sockets, "CLIENT_HWM", 2)
    address = new_ipc_address()
    ctx = zmq.Context()
    stop = threading.Event()
    inputs = make_socket(ctx, zmq.ROUTER, socket_address(address, "input"), True)
    outputs = make_socket(ctx, zmq.ROUTER, socket_address(address, "output"), True)

    def welcome() -> None:  # answers HELLO, never reads a request
        while not stop.is_set():
            if outputs.poll(10):
                identity, _ = outputs.recv_multipart()
                outputs.send_multipart([identity, WELCOME])

    async def main() -> int:
        async with AsyncEngineClient(address) as client:
            prompt = list(range(50_000))
            tasks = []
            while len(tasks) < 1000 and not (tasks and tasks[-1].done()):
                tasks.append(asyncio.create_task(client.generate(prompt)))
                await asyncio.sleep(0)  # the task sends its request
            with pytest.raises(EngineDeadError, match="not reading"):
                await tasks[-1]
            for task in tasks[:-1]:
                task.cancel()
            return len(tasks)

    thread = threading.Thread(target=welcome, daemon=True)
    thread.start()
    try:
        assert asyncio.run(main()) < 1000
    finally:
        stop.set()
        thread.join()
        inputs.close()
        outputs.close()
        ctx.term()
        remove_ipc_files(address)
