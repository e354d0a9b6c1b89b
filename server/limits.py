"""The request body limit, enforced before any body is parsed."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from server.args import DEFAULT_MAX_REQUEST_BODY_BYTES
from server.protocol import APIError

__all__ = ["DEFAULT_MAX_REQUEST_BODY_BYTES", "BodyLimit"]


def _too_large(limit: int) -> str:
    return f"The request body is larger than this server accepts ({limit} bytes)."


class BodyLimit:
    """ASGI middleware: a body announced (Content-Length) larger than `max_bytes` is a
    413 before any of it is read; a body without a length (chunked) is counted as it
    arrives, and reading it fails with a 413 once it passes `max_bytes`."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")  # the server checked its form
        if length.isdigit() and int(length) > self.max_bytes:
            error = APIError(413, _too_large(self.max_bytes))
            await JSONResponse(error.body(), status_code=413)(scope, receive, send)
            return
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI lets an HTTPException raised while reading the body through.
                    raise HTTPException(413, _too_large(self.max_bytes))
            return message

        await self.app(scope, counted_receive, send)
