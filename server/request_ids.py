"""`X-Request-Id`: a request's id, as the client gave it or made here, is answered in the
response's `X-Request-Id` header and names the request in the engine and in the response
body's `id` (vLLM's --enable-request-id-headers, always on: it costs nothing here)."""

from __future__ import annotations

import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request

HEADER = "x-request-id"
MAX_CHARS = 256
_SCOPE_KEY = "splitserve.request_id"


class RequestIdHeader:
    """ASGI middleware: keeps the request's X-Request-Id (a fresh one when it has none, or
    one longer than MAX_CHARS) for `request_id`, and answers it in the response headers."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(HEADER)
        request_id = given if given and len(given) <= MAX_CHARS else uuid.uuid4().hex
        scope[_SCOPE_KEY] = (request_id, given is not None and request_id == given)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_id(raw: Request, body_request_id: str | None) -> str:
    """The request's id: its X-Request-Id header, else the body's `request_id` (vLLM's
    field), else the id made for the response header."""
    made, from_header = raw.scope.get(_SCOPE_KEY, (uuid.uuid4().hex, False))
    return made if from_header or body_request_id is None else body_request_id
