"""Errors in OpenAI's JSON shape `{"error": {"message", "type", "param",
"code"}}`, so clients raise their usual exception types: `APIError`, the app's
exception handlers (an APIError, Starlette's HTTP errors, anything unhandled
as a 500), and the reply to an engine failure.

A 429 or 503 says when to retry (`Retry-After`), so clients back off instead
of hammering a full queue. Messages often carry a library's own error text
(xgrammar's grammar errors, an engine failure); the source-file locations and
log timestamps in it say nothing to a client and tell how the server is
built, so they are cut out of every message.

On the Anthropic Messages API's paths (/v1/messages and below) every error,
whatever raised it (the key, the body's size, JSON or schema, an unknown
model or path, the engine), is told in Anthropic's shape instead, with its
status codes: `{"type": "error", "error": {"type": "invalid_request_error",
"message": ...}}`, the type chosen by status (400 invalid_request_error, 401
authentication_error, 403 permission_error, 404 not_found_error, 413
request_too_large, 429 rate_limit_error, 500 api_error, and this server's 503s,
a full queue or an engine not running, as 529 overloaded_error). Anthropic's
error object has no `param`, so the message names it when it does not already."""

from __future__ import annotations

import json
import logging
import re

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match

from agentserve.server.messages_protocol import AnthropicError, AnthropicErrorResponse
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

    def anthropic_status(self) -> int:
        return 529 if self.status == 503 else self.status

    def anthropic_body(self) -> dict:
        kind = _ANTHROPIC_TYPES.get(self.anthropic_status(), "api_error" if self.status >= 500
                                    else "invalid_request_error")
        message = self.message
        if self.param and self.param not in message:
            message = f"{self.param}: {message}"
        return AnthropicErrorResponse(error=AnthropicError(type=kind, message=message)).model_dump()

    def response(self, path: str = "") -> JSONResponse:
        """The reply, in the shape of the API that `path` (the request's) belongs to."""
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        if anthropic_path(path):
            return JSONResponse(self.anthropic_body(), status_code=self.anthropic_status(), headers=headers)
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    529: "overloaded_error"}


def anthropic_path(path: str) -> bool:
    """Whether `path` is the Anthropic Messages API's (its errors take Anthropic's shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error_event(err: APIError) -> str:
    """An error inside an Anthropic event stream (after the 200), as Anthropic sends it."""
    return f"event: error\ndata: {json.dumps(err.anthropic_body())}\n\n"


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response(request.url.path)


async def http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    msg = f"{request.method} {request.url.path}: {exc.detail}"
    reply = APIError(exc.status_code, msg, code=kind).response(request.url.path)
    if exc.status_code == 405:  # RFC 9110: a 405 names the methods the path has
        reply.headers["Allow"] = ", ".join(allowed_methods(request))
    return reply


def allowed_methods(request: Request) -> list[str]:
    """The methods of every route whose path matches the request's (Starlette's 405 names one route's only)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


async def internal_error_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}", "server_error").response(request.url.path)


def engine_failure(e: Exception) -> APIError:
    return APIError(503 if isinstance(e, EngineStopped) else 500, str(e), "server_error",
                    code="engine_unavailable" if isinstance(e, EngineStopped) else "engine_error")
