"""API keys: the bearer-token check on /v1, and per-tenant prefix-cache salts."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.requests import Request

from server.protocol import APIError

_SCOPE_KEY = "splitserve.api_key"


class BearerAuth:
    """ASGI middleware: /v1/* needs `Authorization: Bearer <key>` with one of `api_keys`.
    The key a request authenticated with is kept for `authenticated_key`."""

    def __init__(self, app, api_keys: Sequence[str]) -> None:
        self.app = app
        self.expected = [(key, f"Bearer {key}".encode()) for key in api_keys]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = Headers(scope=scope).get("authorization", "").encode()
            # Every key is compared, so the time taken says nothing about which matched.
            matches = [key for key, header in self.expected if hmac.compare_digest(given, header)]
            if not matches:
                message = "Invalid API key: send it as 'Authorization: Bearer <key>'."
                error = APIError(401, message, code="invalid_api_key")
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
            scope[_SCOPE_KEY] = matches[0]
        await self.app(scope, receive, send)


def authenticated_key(request: Request) -> str | None:
    """The API key `request` authenticated with (None without BearerAuth)."""
    return request.scope.get(_SCOPE_KEY)


def tenant_cache_salt(api_key: str, cache_salt: str | None) -> str:
    """A salt only holders of `api_key` can produce: an HMAC of the request's own salt
    under the key, so tenants never share prefix-cache blocks (and cannot name each
    other's salts), while one tenant's requests with the same salt still do."""
    message = b"" if cache_salt is None else b"\x01" + cache_salt.encode()
    return hmac.new(api_key.encode(), message, hashlib.sha256).hexdigest()
