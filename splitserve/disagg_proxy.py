"""A prefill/decode disaggregation proxy in front of splitserve's OpenAI-compatible servers.

Per completion or chat request, the next prefill instance (`kv_role: kv_producer`, round
robin) computes the prompt's KV cache: it gets the body with `max_tokens: 1`, not streamed,
and `kv_transfer_params.do_remote_decode: true`, and answers with the `kv_transfer_params`
that let a decode instance pull those blocks. The next decode instance (`kv_consumer`) gets
the client's body plus those params; its answer (JSON or server-sent events) goes back as
it comes. A prefill 4xx is the client's error, answered as is; a prefill failing otherwise
(unreachable, timed out, 5xx, no params) costs latency only: the decode instance computes
the prompt itself. Requests with `n` or `best_of` above 1 cannot share KV: they go straight
to a decode instance.

    python -m splitserve.disagg_proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 http://127.0.0.1:8201 --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import anyio
import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT = 10.0  # an unreachable prefill instance should not hold a request long
HEALTH_TIMEOUT = 5.0
PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    error = {"message": message, "type": kind, "code": status, "param": param}
    return JSONResponse({"error": error}, status_code=status)


def _failed(url: str, exc: httpx.HTTPError) -> JSONResponse:
    logger.warning("%s failed: %r", url, exc)
    if isinstance(exc, httpx.TimeoutException):
        return _error(504, f"{url} did not answer in time", "GatewayTimeoutError")
    return _error(502, f"{url} failed: {type(exc).__name__}", "BadGatewayError")


def _passed_on(answer: httpx.Response) -> Response:
    return Response(
        answer.content, answer.status_code, media_type=answer.headers.get("content-type")
    )


def _encode(body: dict) -> bytes:
    """httpx's `json=` refuses NaN/inf and lone surrogates; the instance should judge them."""
    return json.dumps(body).encode()


def _prefill_body(body: dict) -> dict:
    """One token, not streamed. `min_tokens` goes: the engine refuses it above max_tokens."""
    prefill = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    prefill.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_KV_PARAMS))
    if "max_completion_tokens" in body:
        prefill["max_completion_tokens"] = 1
    return prefill


def _shares_kv(body: dict) -> bool:
    return not any(isinstance(body.get(k), int | float) and body[k] > 1 for k in ("n", "best_of"))


async def _relayed(answer: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in answer.aiter_raw():
            yield chunk
    finally:  # the client left or the stream broke; shielded, as the stream may be cancelled
        with anyio.CancelScope(shield=True):
            await answer.aclose()


class _Proxy:
    def __init__(self, prefill_urls: Sequence[str], decode_urls: Sequence[str]) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("the proxy needs a prefill and a decode instance at least")
        self.prefill_urls = [url.rstrip("/") for url in prefill_urls]
        self.decode_urls = [url.rstrip("/") for url in decode_urls]
        self._prefill = itertools.cycle(self.prefill_urls)
        self._decode = itertools.cycle(self.decode_urls)
        self.client: httpx.AsyncClient

    async def complete(self, request: Request, path: str, request_id: str) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "BadRequestError")
        if "kv_transfer_params" in body:
            message = "kv_transfer_params is the proxy's to set; a request must not carry it"
            return _error(400, message, "BadRequestError", "kv_transfer_params")
        headers = {
            "X-Request-Id": request_id,
            "Accept-Encoding": "identity",
            "Content-Type": "application/json",
        }
        if "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        if _shares_kv(body):
            kv_params = await self._prefill_kv(path, body, headers)
            if isinstance(kv_params, Response):
                return kv_params
            if kv_params is not None:
                body = {**body, "kv_transfer_params": kv_params}
        return await self._decoded(path, body, headers)

    async def _prefill_kv(self, path: str, body: dict, headers: dict) -> dict | Response | None:
        """The prefill's kv_transfer_params, its 4xx answer, or None to decode without."""
        url = next(self._prefill)
        try:
            answer = await self.client.post(
                url + path, content=_encode(_prefill_body(body)), headers=headers
            )
        except httpx.HTTPError as exc:
            logger.warning("prefill %s failed (%r): decoding without its KV", url, exc)
            return None
        if 400 <= answer.status_code < 500:
            return _passed_on(answer)
        try:
            data = answer.json() if answer.status_code == 200 else None
        except ValueError:
            data = None
        kv_params = data.get("kv_transfer_params") if isinstance(data, dict) else None
        if isinstance(kv_params, dict) and kv_params:
            return kv_params
        logger.warning("prefill %s answered %d, no KV: decoding without", url, answer.status_code)
        return None

    async def _decoded(self, path: str, body: dict, headers: dict) -> Response:
        url = next(self._decode)
        request = self.client.build_request(
            "POST", url + path, content=_encode(body), headers=headers
        )
        try:
            answer = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            return _failed(url, exc)
        media_type = answer.headers.get("content-type", "")
        if media_type.startswith("text/event-stream"):
            # The background task closes the answer if the stream is cancelled unstarted.
            close = BackgroundTask(answer.aclose)
            return StreamingResponse(
                _relayed(answer), answer.status_code, media_type=media_type, background=close
            )
        try:
            await answer.aread()
        except httpx.HTTPError as exc:
            return _failed(url, exc)
        finally:
            await answer.aclose()
        return _passed_on(answer)

    async def models(self, request: Request) -> Response:
        url = next(self._decode)
        headers = {k: v for k, v in request.headers.items() if k == "authorization"}
        try:
            return _passed_on(await self.client.get(url + "/v1/models", headers=headers))
        except httpx.HTTPError as exc:
            return _failed(url, exc)

    async def health(self) -> JSONResponse:
        urls = [*self.prefill_urls, *self.decode_urls]
        healthy = await asyncio.gather(*map(self._healthy, urls))
        split = len(self.prefill_urls)
        if any(healthy[:split]) and any(healthy[split:]):
            return JSONResponse({"status": "ok"})
        down = [url for url, ok in zip(urls, healthy, strict=True) if not ok]
        return JSONResponse({"status": "unhealthy", "unhealthy": down}, status_code=503)

    async def _healthy(self, url: str) -> bool:
        try:
            answer = await self.client.get(url + "/health", timeout=HEALTH_TIMEOUT)
        except httpx.HTTPError:
            return False
        return answer.status_code == 200


def build_app(prefill_urls: Sequence[str], decode_urls: Sequence[str], timeout: float) -> FastAPI:
    proxy = _Proxy(prefill_urls, decode_urls)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Unlimited connections: every streamed answer holds one while it lasts.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeouts = httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT))
        async with httpx.AsyncClient(timeout=timeouts, limits=limits) as client:
            proxy.client = client
            yield

    app = FastAPI(lifespan=lifespan)

    async def complete(request: Request) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        response = await proxy.complete(request, request.url.path, request_id)
        response.headers["X-Request-Id"] = request_id
        return response

    app.add_api_route("/v1/completions", complete, methods=["POST"])
    app.add_api_route("/v1/chat/completions", complete, methods=["POST"])
    app.add_api_route("/v1/models", proxy.models, methods=["GET"])
    app.add_api_route("/health", proxy.health, methods=["GET"])
    return app


def _url(value: str) -> str:
    try:
        url = httpx.URL(value)
    except httpx.InvalidURL:
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.host:
        raise argparse.ArgumentTypeError(f"{value!r} is not an http(s) URL like http://host:8100")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m splitserve.disagg_proxy",
        description="Prefill/decode disaggregation proxy over OpenAI-compatible instances.",
    )
    for role, kind in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        parser.add_argument(
            f"--{role}",
            type=_url,
            nargs="+",
            action="extend",
            required=True,
            metavar="URL",
            help=f"{role} ({kind}) instances, the flag repeatable",
        )
    parser.add_argument("--host", default="0.0.0.0", help="default: %(default)s")
    parser.add_argument("--port", type=int, default=8000, help="default: %(default)s")
    timeout_help = "seconds to wait for an upstream answer (default: %(default)s)"
    parser.add_argument("--timeout", type=float, default=600.0, help=timeout_help)
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    uvicorn.run(build_app(args.prefill, args.decode, args.timeout), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
