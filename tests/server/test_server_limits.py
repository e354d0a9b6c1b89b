"""The server cannot be frozen or flooded: body limits, prompts refused by their size
alone, and tokenizing off the event loop."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from server import build_app
from tests.server.fake_engine import CharTokenizer, FakeEngineClient
from tests.server.harness import LiveServer, asgi_client

LIMIT = 4096


@pytest.fixture(scope="module")
def small_body_server():
    fake = FakeEngineClient()
    app = build_app(fake, fake.tokenizer, "fake-model", max_request_body_bytes=LIMIT)
    server = LiveServer(app, fake)
    yield server
    server.stop()


def test_a_body_announced_over_the_limit_is_413_unread(small_body_server):
    body = {"prompt": "x" * LIMIT, "max_tokens": 2}
    response = httpx.post(small_body_server.url + "/v1/completions", json=body)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and str(LIMIT) in error["message"]


def test_a_chunked_body_is_cut_off_at_the_limit(small_body_server):
    sent = []

    def chunks():
        yield b'{"max_tokens": 2, "prompt": "'
        for _ in range(64):  # 64 KiB in all, far past the limit
            sent.append(1024)
            yield b"x" * 1024
        yield b'"}'

    headers = {"content-type": "application/json"}
    url = small_body_server.url + "/v1/completions"
    try:
        response = httpx.post(url, content=chunks(), headers=headers)
    except httpx.RemoteProtocolError:
        pytest.fail("the server closed the connection without an answer")
    assert response.status_code == 413
    assert "error" in response.json()


def test_a_body_under_the_limit_is_served(small_body_server):
    response = httpx.post(
        small_body_server.url + "/v1/completions", json={"prompt": "x" * 100, "max_tokens": 2}
    )
    assert response.status_code == 200


class CountingTokenizer(CharTokenizer):
    """Counts the characters it tokenizes; texts over `slow_chars` take `delay` seconds."""

    def __init__(self, slow_chars: int = 10**9, delay: float = 0.0) -> None:
        self.slow_chars = slow_chars
        self.delay = delay
        self.encoded_chars = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded_chars += len(text)
        if len(text) > self.slow_chars:
            time.sleep(self.delay)  # a long tokenization, in whichever thread runs it
        return super().encode(text, add_special_tokens)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_prompt_too_long_in_bytes_is_refused_without_tokenizing(path):
    fake = FakeEngineClient()
    tokenizer = CountingTokenizer()
    app = build_app(fake, tokenizer, "fake-model", max_model_len=512)
    text = "é" * 1024  # 2048 bytes: at least 512 tokens of at most 4 bytes
    body = {"messages": [{"role": "user", "content": text}]} if "chat" in path else {"prompt": text}

    async def main() -> httpx.Response:
        async with asgi_client(app) as client:
            return await client.post(path, json=body)

    response = asyncio.run(main())
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "512 tokens" in error["message"]
    assert tokenizer.encoded_chars == 0 and not fake.requests


def test_a_prompt_that_may_fit_is_tokenized():
    fake = FakeEngineClient()
    tokenizer = CountingTokenizer()
    app = build_app(fake, tokenizer, "fake-model", max_model_len=512)

    async def main() -> httpx.Response:
        async with asgi_client(app) as client:
            body = {"prompt": "😀" * 500, "max_tokens": 2}
            return await client.post("/v1/completions", json=body)

    assert asyncio.run(main()).status_code == 200  # 2000 bytes, 501 tokens
    assert tokenizer.encoded_chars == 500


def test_a_small_request_is_answered_while_a_huge_prompt_is_tokenized():
    fake = FakeEngineClient()
    tokenizer = CountingTokenizer(slow_chars=100_000, delay=1.0)
    app = build_app(fake, tokenizer, "fake-model")
    finished: list[str] = []
    huge_started = threading.Event()

    async def post(client: httpx.AsyncClient, name: str, body: dict) -> None:
        if name == "small":
            await asyncio.to_thread(huge_started.wait, 10)
            await asyncio.sleep(0.2)  # the huge prompt is being tokenized by now
        else:
            huge_started.set()
        response = await client.post("/v1/completions", json={"max_tokens": 2, **body})
        assert response.status_code == 200
        finished.append(name)

    async def main() -> None:
        async with asgi_client(app) as client:
            await asyncio.gather(
                post(client, "huge", {"prompt": "x" * 1_000_000}),
                post(client, "small", {"prompt": "Hi"}),
            )

    asyncio.run(main())
    assert finished == ["small", "huge"]
