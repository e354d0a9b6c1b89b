"""splitserve/disagg_proxy.py against fake prefill and decode instances: small FastAPI apps
that record what they get, served with the proxy by uvicorn in threads and called over
HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from splitserve.disagg_proxy import PREFILL_KV_PARAMS, build_app, parse_args
from tests.import_graph import ROOT

KV_PARAMS = {
    "remote_engine_id": "e1",
    "remote_block_ids": [[1, 2]],
    "remote_host": "127.0.0.1",
    "remote_port": 1234,
    "transfer_id": "t",
    "transfer_key": "k",
}
COMPLETION = {"model": "m", "prompt": "Hello", "max_tokens": 8, "temperature": 0.5}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


@dataclass
class Call:
    path: str
    body: object
    headers: dict[str, str]


@dataclass
class Fake:
    """An instance: it records each call and answers as its fields say."""

    name: str
    calls: list[Call] = field(default_factory=list)
    status: int = 200
    kv_params: object = None
    healthy: bool = True
    gate: threading.Event = field(default_factory=threading.Event)  # cleared: hold on
    endless: bool = False
    closed: threading.Event = field(default_factory=threading.Event)

    def reset(self) -> None:
        self.calls.clear()
        self.status, self.healthy, self.endless = 200, True, False
        self.kv_params = KV_PARAMS if self.name.startswith("p") else None
        self.gate.set()
        self.closed.clear()

    def answer(self) -> bytes:
        return json.dumps({"id": self.name, "choices": [{"text": "x"}]}).encode()

    def chunks(self) -> list[bytes]:
        return [f'data: {{"id": "{self.name}", "i": {i}}}\n\n'.encode() for i in range(3)] + [
            b"data: [DONE]\n\n"
        ]

    def app(self) -> FastAPI:
        app = FastAPI()

        async def complete(request: Request) -> Response:
            body = json.loads(await request.body())
            self.calls.append(Call(request.url.path, body, dict(request.headers)))
            if self.status != 200:
                error = {"message": f"{self.name} says {self.status}", "code": self.status}
                return JSONResponse({"error": error}, status_code=self.status)
            if self.name.startswith("p"):
                await self._wait_gate()
                return JSONResponse({"id": self.name, "kv_transfer_params": self.kv_params})
            if body.get("stream"):
                return StreamingResponse(self._stream(), media_type="text/event-stream")
            return Response(self.answer(), media_type="application/json")

        async def models(request: Request) -> Response:
            self.calls.append(Call(request.url.path, None, dict(request.headers)))
            return Response(b'{"object":"list","data":[{"id":"m"}]}', media_type="application/json")

        async def health() -> Response:
            return Response(status_code=200 if self.healthy else 503)

        app.add_api_route("/v1/completions", complete, methods=["POST"])
        app.add_api_route("/v1/chat/completions", complete, methods=["POST"])
        app.add_api_route("/v1/models", models, methods=["GET"])
        app.add_api_route("/health", health, methods=["GET"])
        return app

    async def _wait_gate(self) -> None:
        """A prefill holds its answer, a decode instance its chunks after the first."""
        deadline = time.monotonic() + 10
        while (self.endless or not self.gate.is_set()) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    async def _stream(self):
        first, *rest = self.chunks()
        try:
            yield first
            await self._wait_gate()
            for chunk in rest:
                yield chunk
        finally:
            self.closed.set()


@contextlib.contextmanager
def served(app: FastAPI) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.005)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def fakes() -> Iterator[dict[str, tuple[Fake, str]]]:
    with contextlib.ExitStack() as stack:
        found = {}
        for name in ("p1", "p2", "d1", "d2"):
            fake = Fake(name)
            found[name] = fake, stack.enter_context(served(fake.app()))
        yield found


@pytest.fixture(autouse=True)
def _reset(fakes):
    for fake, _ in fakes.values():
        fake.reset()


@pytest.fixture(scope="module")
def down_url() -> Iterator[str]:
    """A port bound but not listening: connections to it are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def proxy_for(fakes, down_url):
    """proxy_for("p1,p2", "d1", timeout): the URL of a proxy over those instances ("down"
    names down_url), started once per set; their URLs end in a slash, which it drops."""
    urls = {name: url + "/" for name, (_, url) in fakes.items()} | {"down": down_url}
    started: dict[tuple, str] = {}
    with contextlib.ExitStack() as stack:

        def proxy_for(prefill: str, decode: str, timeout: float = 30.0) -> str:
            key = (prefill, decode, timeout)
            if key not in started:
                pick = (
                    [urls[name] for name in prefill.split(",")],
                    [urls[name] for name in decode.split(",")],
                )
                started[key] = stack.enter_context(served(build_app(*pick, timeout)))
            return started[key]

        yield proxy_for


@pytest.fixture
def proxy(proxy_for) -> str:
    return proxy_for("p1", "d1")


@pytest.fixture
def p1(fakes) -> Fake:
    return fakes["p1"][0]


@pytest.fixture
def d1(fakes) -> Fake:
    return fakes["d1"][0]


def _expected_prefill(body: dict) -> dict:
    expected = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    expected.update(max_tokens=1, stream=False, kv_transfer_params=PREFILL_KV_PARAMS)
    if "max_completion_tokens" in body:
        expected["max_completion_tokens"] = 1
    return expected


CASES = [
    ("/v1/completions", COMPLETION),
    ("/v1/completions", {**COMPLETION, "min_tokens": 4, "logprobs": 2}),
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 5}),
]


@pytest.mark.parametrize(("path", "body"), CASES)
def test_a_request_is_prefilled_then_decoded_with_the_prefills_kv(proxy, p1, d1, path, body):
    answer = httpx.post(proxy + path, json=body)
    assert answer.status_code == 200 and answer.content == d1.answer()
    assert answer.headers["content-type"] == "application/json"
    [prefilled] = p1.calls
    assert prefilled.path == path and prefilled.body == _expected_prefill(body)
    [decoded] = d1.calls
    assert decoded.path == path and decoded.body == {**body, "kv_transfer_params": KV_PARAMS}


@pytest.mark.parametrize(("path", "body"), CASES[::2])
def test_a_stream_is_passed_through_chunk_by_chunk(proxy, p1, d1, path, body):
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    d1.gate.clear()  # d1 holds all but its first chunk until the client has it
    with httpx.stream("POST", proxy + path, json=body) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        chunks = answer.iter_raw()
        first = next(chunks)
        d1.gate.set()
        received = first + b"".join(chunks)
    first_sent, *_ = d1.chunks()
    assert first == first_sent and received == b"".join(d1.chunks())
    assert p1.calls[0].body == _expected_prefill(body)
    assert d1.calls[0].body == {**body, "kv_transfer_params": KV_PARAMS}


def test_the_upstream_stream_closes_when_the_client_leaves(proxy, d1):
    d1.endless = True
    with httpx.stream("POST", proxy + "/v1/completions", json={**COMPLETION, "stream": True}) as a:
        next(a.iter_raw())
    assert d1.closed.wait(5)


def test_instances_take_turns(proxy_for, fakes):
    url = proxy_for("p1,p2", "d1,d2")
    turns = []
    for _ in range(4):
        assert httpx.post(url + "/v1/completions", json=COMPLETION).status_code == 200
        turns.append([name for name, (fake, _) in fakes.items() if fake.calls])
        assert len(turns[-1]) == 2
        for fake, _ in fakes.values():
            fake.calls.clear()
    prefills, decodes = ([turn[i] for turn in turns] for i in (0, 1))
    for names in (prefills, decodes):
        assert names[0] != names[1] and names == names[:2] * 2


@pytest.mark.parametrize("failure", ["down", "500", "no kv params", "timeout"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_prefill_leaves_the_prompt_to_the_decode_instance(
    proxy_for, p1, d1, failure, stream
):
    url = proxy_for("down", "d1") if failure == "down" else proxy_for("p1", "d1")
    if failure == "500":
        p1.status = 500
    elif failure == "no kv params":
        p1.kv_params = None
    elif failure == "timeout":  # the prefill never answers; the decode must within it
        url = proxy_for("p1", "d1", timeout=1.5)
        p1.gate.clear()
    body = {**COMPLETION, "stream": stream}
    answer = httpx.post(url + "/v1/completions", json=body)
    assert answer.status_code == 200
    assert answer.content == (b"".join(d1.chunks()) if stream else d1.answer())
    [decoded] = d1.calls
    assert decoded.body == body


def test_a_prefill_4xx_is_the_answer(proxy, p1, d1):
    p1.status = 422
    answer = httpx.post(proxy + "/v1/chat/completions", json={**CHAT, "stream": True})
    assert answer.status_code == 422
    assert answer.json() == {"error": {"message": "p1 says 422", "code": 422}}
    assert d1.calls == []


def test_a_decode_instance_down_is_a_502(proxy_for, p1, d1):
    answer = httpx.post(proxy_for("p1", "down") + "/v1/completions", json=COMPLETION)
    assert answer.status_code == 502 and answer.json()["error"]["type"] == "BadGatewayError"


def test_a_decode_error_is_passed_on(proxy, d1):
    d1.status = 400
    answer = httpx.post(proxy + "/v1/completions", json={**COMPLETION, "stream": True})
    assert answer.status_code == 400 and answer.json()["error"]["message"] == "d1 says 400"


@pytest.mark.parametrize("field_name", ["n", "best_of"])
def test_several_choices_skip_the_prefill(proxy, p1, d1, field_name):
    body = {**COMPLETION, field_name: 2}
    assert httpx.post(proxy + "/v1/completions", json=body).content == d1.answer()
    assert p1.calls == [] and d1.calls[0].body == body


def _bad_request(answer: httpx.Response) -> str:
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    return error["message"]


def test_a_request_must_not_carry_kv_transfer_params(proxy, p1, d1):
    body = {**COMPLETION, "kv_transfer_params": {"do_remote_decode": True}}
    assert "kv_transfer_params" in _bad_request(httpx.post(proxy + "/v1/completions", json=body))
    assert p1.calls == [] and d1.calls == []


@pytest.mark.parametrize("content", [b"[1, 2]", b"not json", b"\xff", b'"text"', b""])
def test_a_body_must_be_a_json_object(proxy, d1, content):
    answer = httpx.post(proxy + "/v1/chat/completions", content=content)
    assert "JSON object" in _bad_request(answer)
    assert d1.calls == []


def test_authorization_and_one_request_id_reach_both_instances(proxy, p1, d1):
    headers = {"Authorization": "Bearer sk-1", "X-Request-Id": "req-7"}
    answer = httpx.post(proxy + "/v1/completions", json=COMPLETION, headers=headers)
    assert answer.headers["x-request-id"] == "req-7"
    for call in (*p1.calls, *d1.calls):
        assert call.headers["authorization"] == "Bearer sk-1"
        assert call.headers["x-request-id"] == "req-7"
        assert call.headers["content-type"] == "application/json"  # FastAPI parses only that


def test_a_request_id_is_made_when_the_client_sends_none(proxy, p1, d1):
    with httpx.stream("POST", proxy + "/v1/completions", json={**COMPLETION, "stream": True}) as a:
        request_id = a.headers["x-request-id"]
        a.read()
    assert len(request_id) == 32 and int(request_id, 16) >= 0
    assert p1.calls[0].headers["x-request-id"] == d1.calls[0].headers["x-request-id"] == request_id
    assert "authorization" not in p1.calls[0].headers


def test_models_come_from_a_decode_instance(proxy, d1):
    answer = httpx.get(proxy + "/v1/models", headers={"Authorization": "Bearer sk-1"})
    assert answer.status_code == 200 and answer.content == b'{"object":"list","data":[{"id":"m"}]}'
    assert d1.calls[0].headers["authorization"] == "Bearer sk-1"


def test_an_unknown_route_is_a_404(proxy):
    assert httpx.get(proxy + "/v1/embeddings").status_code == 404


def test_health_needs_one_healthy_instance_of_each_role(proxy_for, fakes, down_url):
    url = proxy_for("p1,p2", "d1,d2")
    p1, p2, d1, d2 = (fakes[name][0] for name in ("p1", "p2", "d1", "d2"))
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    p1.healthy = d2.healthy = False
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    d1.healthy = False
    answer = httpx.get(url + "/health")
    assert answer.status_code == 503
    assert answer.json()["unhealthy"] == [fakes[name][1] for name in ("p1", "d1", "d2")]
    answer = httpx.get(proxy_for("down", "d1") + "/health")
    assert answer.status_code == 503 and answer.json()["unhealthy"] == [down_url, fakes["d1"][1]]


def test_arguments_take_several_urls_per_flag_and_repeated_flags():
    args = parse_args(
        ["--prefill", "http://a:1", "https://b/", "--decode", "http://c:3", "--prefill", "http://d"]
    )
    assert args.prefill == ["http://a:1", "https://b/", "http://d"]
    assert args.decode == ["http://c:3"]
    assert (args.host, args.port, args.timeout) == ("0.0.0.0", 8000, 600.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill", "ftp://a", "--decode", "http://c"], "'ftp://a' is not an http(s) URL"),
        (["--prefill", "a:1", "--decode", "http://c"], "'a:1' is not an http(s) URL"),
        (["--prefill", "http://a"], "--decode"),
        (["--prefill", "http://a", "--decode", "http://c", "--timeout", "0"], "positive"),
    ],
)
def test_bad_arguments_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("urls", [([], ["http://d"]), (["http://p"], [])])
def test_the_app_needs_instances_of_both_roles(urls):
    with pytest.raises(ValueError, match="at least"):
        build_app(*urls, 1.0)


def test_the_module_serves(fakes):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    urls = ["--prefill", fakes["p1"][1], "--decode", fakes["d1"][1]]
    command = [sys.executable, "-m", "splitserve.disagg_proxy", *urls, "--port", str(port)]
    command += ["--host", "127.0.0.1"]
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 20
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "proxy did not start"
            with contextlib.suppress(httpx.TransportError):
                answer = httpx.get(f"http://127.0.0.1:{port}/health")
                break
            time.sleep(0.05)
        assert answer.json() == {"status": "ok"}
    finally:
        process.terminate()
        process.wait(10)


def test_values_json_cannot_encode_strictly_are_left_to_the_instances(proxy, p1, d1):
    content = b'{"model": "m", "prompt": "\\ud800", "temperature": 1e999}'
    assert httpx.post(proxy + "/v1/completions", content=content).status_code == 200
    for call in (*p1.calls, *d1.calls):
        assert call.body["prompt"] == "\ud800" and call.body["temperature"] == float("inf")
