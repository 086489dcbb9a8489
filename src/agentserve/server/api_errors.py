"""Errors in OpenAI's JSON shape `{"error": {"message", "type", "param",
"code"}}`, so clients raise their usual exception types: `APIError`, the app's
exception handlers (an APIError, Starlette's HTTP errors, anything unhandled
as a 500), and the reply to an engine failure.

A 429 or 503 says when to retry (`Retry-After`), so clients back off instead
of hammering a full queue. Messages often carry a library's own error text
(xgrammar's grammar errors, an engine failure); the source-file locations and
log timestamps in it say nothing to a client and tell how the server is
built, so they are cut out of every message."""

from __future__ import annotations

import logging
import re

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentserve.server.protocol import ErrorBody, ErrorResponse
from agentserve.server.request_stream import EngineStopped

log = logging.getLogger("agentserve.server")

RETRY_AFTER_S = 1  # a queue drains in about a step's time; a client that waits longer loses nothing

# "[04:45:08] " log stamps, and source locations: an absolute path (POSIX or
# Windows) to a source file, with its line number ("/x/y.cc:4944: ") or in a
# Python traceback's form ('File "/x/y.py", line 3, ')
_TIMESTAMP = re.compile(r"\[\d{2}:\d{2}:\d{2}\]\s*")
_SOURCE = re.compile(r'(?:File\s+)?"?(?:[A-Za-z]:)?[/\\][^\s"\']*\.(?:cc|cpp|cxx|c|h|hpp|cu|py|pyx|rs|go)"?'
                     r'(?:(?::\d+)+:?|,\s*line\s+\d+,?)?\s*')


def scrub_internal_paths(message: str) -> str:
    """`message` without source locations and log timestamps (what remains is the useful part)."""
    out = _SOURCE.sub("", _TIMESTAMP.sub("", message)).strip()
    return out or "an internal error (details are in the server's log)"


class APIError(Exception):
    """An error reply in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: int | None = None) -> None:
        message = scrub_internal_paths(message)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        if retry_after is None and status in (429, 503):
            retry_after = RETRY_AFTER_S
        self.retry_after = retry_after

    def body(self) -> dict:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


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
