"""The server under test: build_app over an engine client, served by uvicorn in a thread
(LiveServer) or called in the test's event loop (asgi_client), and the EngineHarness that
describes the engine client behind it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import uvicorn

from server import build_app

API_KEY = "test-key"


@dataclass
class EngineHarness:
    """An engine client not yet connected (the server thread connects it in its own event
    loop); `aborted(request_id)` tells whether the engine saw that request aborted."""

    client: Any
    tokenizer: Any
    model_name: str
    max_model_len: int
    aborted: Callable[[str], bool]
    vocab_size: int | None = None
    text_prompt: str = "Tell me"  # a prompt whose answer has text to cut at a stop string


class LiveServer:
    """Serves `app` on 127.0.0.1:<free port> from a thread with its own event loop."""

    def __init__(self, app, client) -> None:
        self.client = client
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),))
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    async def _main(self) -> None:
        await self.client.connect()
        try:
            await self.server.serve(sockets=[self.sock])
        finally:
            await self.client.close()

    def call(self, coro: Coroutine, timeout: float = 30.0):
        """Run a coroutine (say, on the engine client) in the server's event loop."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.loop.close()


def asgi_client(app, api_key: str | None = None) -> httpx.AsyncClient:
    """An httpx client calling `app` in this event loop (no lifespan, no socket); the
    app's unexpected exceptions are answered, as a server would, not raised here."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(transport=transport, base_url="http://test", headers=headers)


@contextlib.contextmanager
def smollm2_server(tmp_path, max_model_len: int = 512) -> Iterator[openai.OpenAI]:
    """An openai client of the HTTP server over a launch.py cluster of the default model
    (served as "smollm2")."""
    from ipc.client import AsyncEngineClient
    from ipc.tokenizer import Tokenizer
    from models.default import default_model_path
    from tests.cluster.helpers import launch_cluster

    model = default_model_path()
    with launch_cluster(tmp_path, model, "--max-model-len", str(max_model_len)) as running:
        tokenizer = Tokenizer.from_pretrained(model)
        client = AsyncEngineClient(running.address, tokenizer=tokenizer)
        app = build_app(client, tokenizer, "smollm2", API_KEY, max_model_len)
        server = LiveServer(app, client)
        try:
            yield openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        finally:
            server.stop()
