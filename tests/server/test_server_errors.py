"""Engine failures and the server's own bugs reach clients as OpenAI-shaped errors that
name no address, pid or other internals; streams end with an error event, then [DONE]."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI

from ipc.client import EngineDeadError, RequestError
from ipc.messages import ErrorCode
from server import build_app
from tests.server.fake_engine import CharTokenizer, FakeEngineClient
from tests.server.harness import asgi_client

INTERNALS = "worker rank 1 (pid 4242) left the gloo group at tcp://10.1.2.3:29500"
STREAM = {"stream": True, "stream_options": {"include_usage": True}}


def post(app, body: dict) -> httpx.Response:
    async def main() -> httpx.Response:
        async with asgi_client(app) as client:
            return await client.post("/v1/completions", json={"prompt": "Hi", **body})

    return asyncio.run(main())


def events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.text.split("\n\n") if line.startswith("data: ")]


def failing_app(after_tokens: int, error: Exception) -> FastAPI:
    fake = FakeEngineClient()
    fake.failure = (after_tokens, error)
    return build_app(fake, fake.tokenizer, "fake-model")


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (RequestError(INTERNALS, ErrorCode.INTERNAL), 500, "server_error"),
        (RequestError(INTERNALS, ErrorCode.UNAVAILABLE), 503, "service_unavailable"),
        (EngineDeadError(INTERNALS), 503, "service_unavailable"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_engine_failures_keep_their_internals_in_the_log(error, status, kind, stream, caplog):
    response = post(failing_app(0, error), {"max_tokens": 5, **(STREAM if stream else {})})
    assert response.status_code == status
    body = response.json()["error"]
    assert body["type"] == kind and body["message"]
    for secret in ("pid", "4242", "gloo", "tcp://", "10.1.2.3", "rank"):
        assert secret not in response.text
    assert INTERNALS in caplog.text


def test_an_internal_engine_failure_names_the_request():
    response = post(failing_app(0, RequestError(INTERNALS, ErrorCode.INTERNAL)), {})
    message = response.json()["error"]["message"]
    assert "the engine failed while processing this request" in message.lower()
    assert response.json()["error"]["message"].count("cmpl-") == 1


def test_an_invalid_request_keeps_the_engine_message():
    error = RequestError("max_tokens exceeds what the engine allows", ErrorCode.INVALID_REQUEST)
    response = post(failing_app(0, error), {})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "max_tokens exceeds what the engine allows"


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (RequestError(INTERNALS, ErrorCode.INTERNAL), "server_error"),
        (RequestError(INTERNALS, ErrorCode.UNAVAILABLE), "service_unavailable"),
        (EngineDeadError(INTERNALS), "service_unavailable"),
        (RuntimeError(INTERNALS), "server_error"),
    ],
)
def test_a_failure_mid_stream_ends_with_an_error_event_then_done(error, kind):
    response = post(failing_app(3, error), {"max_tokens": 20, **STREAM})
    assert response.status_code == 200
    data = events(response)
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["type"] == kind
    assert json.loads(data[-3])["object"] == "text_completion"  # the chunks before, no usage
    assert "gloo" not in response.text and "4242" not in response.text


def test_sse_data_lines_escape_unicode_line_separators():
    reply = "a\u2028b\u2029c\u0085d\re\nf"
    fake = FakeEngineClient(reply=reply)
    app = build_app(fake, fake.tokenizer, "fake-model")
    response = post(app, {"max_tokens": len(reply) + 1, **STREAM})
    for separator in ("\u2028", "\u2029", "\u0085", "\r"):
        assert separator not in response.text
    lines = response.text.splitlines()  # what a client splitting on every line break sees
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in data if c["choices"]) == reply


class BrokenTokenizer(CharTokenizer):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise RuntimeError(INTERNALS)


def test_unexpected_exceptions_are_500_in_openai_shape():
    fake = FakeEngineClient()
    app = build_app(fake, BrokenTokenizer(), "fake-model")
    response = post(app, {})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and set(error) == {"message", "type", "param", "code"}
    assert "gloo" not in response.text and not fake.requests
