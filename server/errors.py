"""Every failure becomes an OpenAI-shaped error; what the engine or the server's own code
says about its internals (addresses, pids, process groups) stays in the log."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from ipc.client import EngineDeadError, RequestError
from ipc.messages import ErrorCode
from server.protocol import UNSUPPORTED, APIError

logger = logging.getLogger(__name__)

UNAVAILABLE = "The engine is not available right now. Please try again later."
UNEXPECTED = "The server had an error while processing your request."
_REFUSALS = (UNSUPPORTED, "extra_forbidden")


class ClientDisconnected(Exception):
    pass


def engine_error(error: RequestError | EngineDeadError, request_id: str) -> APIError:
    """The answer to a request the engine refused or failed, or could not take."""
    if isinstance(error, RequestError) and error.code == ErrorCode.INVALID_REQUEST:
        return APIError(400, str(error))
    if isinstance(error, RequestError) and error.code != ErrorCode.UNAVAILABLE:
        logger.error("request %s failed in the engine: %s", request_id, error)
        message = f"The engine failed while processing this request ({request_id})."
        return APIError(500, message)
    logger.error("request %s: the engine is unavailable: %s", request_id, error)
    return APIError(503, UNAVAILABLE)


def validation_error(errors: Sequence[dict]) -> APIError:
    """The 400 for a body pydantic refused: a refused field's error comes first (a union
    reports every branch's error), and `param` names the top-level field."""
    error = next((e for e in errors if e["type"] in _REFUSALS), errors[0])
    # Union branches show in `loc` as types ("list[ContentPart]"): left out of the path.
    path = [str(p) for p in error["loc"] if isinstance(p, int) or str(p).isidentifier()]
    path = path[1:] if path[:1] == ["body"] else path
    if error["type"] == UNSUPPORTED:
        field = error.get("ctx", {}).get("field")
        return APIError(400, error["msg"], (path or [field])[0])
    param = path[0] if path else None
    if error["type"] == "extra_forbidden":
        return APIError(400, f"`{'.'.join(path)}` is not supported by this server", param)
    message = f"invalid value for {param}: {error['msg']}" if param else error["msg"]
    return APIError(400, message, param)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> Response:
        return JSONResponse(validation_error(exc.errors()).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        body = APIError(exc.status_code, str(exc.detail)).body()
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> Response:
        # Starlette raises `exc` again once this answer is sent: the server logs it.
        return JSONResponse(APIError(500, UNEXPECTED).body(), status_code=500)
