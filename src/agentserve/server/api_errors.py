"""Errors in OpenAI's JSON shape `{"error": {"message", "type", "param",
"code"}}`, so clients raise their usual exception types: `APIError`, the app's
exception handlers (an APIError, Starlette's HTTP errors, anything unhandled
as a 500), and the reply to an engine failure."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentserve.server.protocol import ErrorBody, ErrorResponse
from agentserve.server.request_stream import EngineStopped

log = logging.getLogger("agentserve.server")


class APIError(Exception):
    """An error reply in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    msg = f"{request.method} {request.url.path}: {exc.detail}"
    return APIError(exc.status_code, msg, code=kind).response()


async def internal_error_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}", "server_error").response()


def engine_failure(e: Exception) -> APIError:
    return APIError(503 if isinstance(e, EngineStopped) else 500, str(e), "server_error",
                    code="engine_unavailable" if isinstance(e, EngineStopped) else "engine_error")
