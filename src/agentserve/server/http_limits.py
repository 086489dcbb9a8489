"""What the HTTP layer bounds before a request's own checks run, and what it
takes calmly: an ASGI middleware (`HttpLimits`, inside Starlette's error
middleware, outside its exception handlers) around every route.

- Connections in progress, in total and per client address
  (`max_connections`, `max_connections_per_client`): past either, a 503 with
  `Retry-After` in the API's error shape (Anthropic's 529 on its paths), and
  the connection is closed, so a client that opens many and stalls them holds
  no more than its share. A connection counts while it carries a request,
  streams included; an idle keep-alive one does not (uvicorn closes those
  after its keep-alive timeout). The client address is the one uvicorn
  reports: the peer's, or X-Forwarded-For's from a trusted proxy (uvicorn's
  --forwarded-allow-ips).
- A body that stops arriving (`request_body_timeout`): each wait for the
  next piece of a body that is not complete is bounded by it, so silence is
  timed, never the whole upload: a slow client that keeps sending is never
  cut. Past it the request gets a 408 in the API's error shape and the
  connection is closed.
- A client that goes away before its response starts (mid-body, or while
  its request is computed) is an ordinary event: no traceback and no 500,
  one INFO line at most per second with the path and the bytes of the body
  read (the lines skipped meanwhile are counted in the next one).

What uvicorn itself bounds and this layer relies on: a request head larger
than its limit is refused before the app sees it, and an idle keep-alive
connection is closed after `timeout_keep_alive` (5 s). A connection that
never finishes its request head is uvicorn's alone (it has no timeout for
that): a server open to untrusted clients belongs behind a proxy that
times out slow heads."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentserve.server.api_errors import APIError

log = logging.getLogger("agentserve.server")

LOG_INTERVAL_S = 1.0  # the least time between two lines about clients gone or bodies timed out


class RateLimitedLog:
    """INFO lines of one kind, at most one per `interval` seconds; a line
    says how many were skipped since the one before it."""

    def __init__(self, logger: logging.Logger, interval: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.interval, self.clock = logger, interval, clock
        self.last: float | None = None
        self.skipped = 0

    def info(self, msg: str, *args: Any) -> None:
        now = self.clock()
        if self.last is not None and now - self.last < self.interval:
            self.skipped += 1
            return
        if self.skipped:
            msg += f" ({self.skipped} more like it since the last such line)"
        self.logger.info(msg, *args)
        self.last, self.skipped = now, 0


class BodyTimeout(APIError):
    """A body that stopped arriving: a 408 whose reply closes the connection."""

    def __init__(self, timeout: float, received: int, declared: int | None) -> None:
        of = f" of {declared}" if declared is not None else ""
        super().__init__(408, f"no part of the request body arrived for {timeout:g} s ({received}{of} bytes "
                              f"received); send the body without pauses that long (--request-body-timeout)",
                         code="request_timeout")

    def response(self, path: str = "") -> JSONResponse:
        reply = super().response(path)
        reply.headers["Connection"] = "close"
        return reply


class _Upload:
    """What a request's body has done so far."""

    __slots__ = ("received", "complete", "gone", "started")

    def __init__(self) -> None:
        self.received = 0  # body bytes read
        self.complete = False  # the last piece arrived
        self.gone = False  # the client went away before the response started
        self.started = False  # the response has started


class HttpLimits:
    """The middleware; its limits come from the server's config (`ServerConfig`'s
    `request_body_timeout`, `max_connections`, `max_connections_per_client`)."""

    def __init__(self, app: ASGIApp, *, body_timeout: float | None = None, max_connections: int | None = None,
                 max_per_client: int | None = None) -> None:
        self.app = app
        self.body_timeout = body_timeout or None
        self.max_connections = max_connections or None
        self.max_per_client = max_per_client or None
        self.in_progress = 0
        self.by_client: Counter[str] = Counter()
        self.clients_gone = 0  # requests whose client went away before their response started
        self.gone_log = RateLimitedLog(log)
        self.timeout_log = RateLimitedLog(log)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        addr = str(client[0]) if client else ""
        refusal = self._refusal(addr)
        if refusal is not None:
            reply = refusal.response(scope.get("path", ""))
            reply.headers["Connection"] = "close"
            await reply(scope, receive, send)
            return
        self.in_progress += 1
        self.by_client[addr] += 1
        upload = _Upload()
        try:
            await self.app(scope, self._receiver(scope, receive, upload), self._sender(send, upload))
        except ClientDisconnect:
            upload.gone = upload.gone or not upload.started  # the reply, if any, reaches nobody
        except BodyTimeout as e:  # (only if the body was read where no handler catches it; logged already)
            if not upload.started:
                await e.response(scope.get("path", ""))(scope, receive, send)
        finally:
            self.in_progress -= 1
            self.by_client[addr] -= 1
            if not self.by_client[addr]:
                del self.by_client[addr]
        if upload.gone:
            self.clients_gone += 1
            self.gone_log.info("client went away before its response: %s %s, after %d%s bytes of its body",
                               scope.get("method", ""), scope.get("path", ""), upload.received,
                               _of_declared(scope))

    def _refusal(self, addr: str) -> APIError | None:
        if self.max_connections is not None and self.in_progress >= self.max_connections:
            return APIError(503, f"the server has {self.in_progress} connections in progress, its limit "
                                 f"(--max-connections); retry shortly", "server_error", code="too_many_connections")
        if self.max_per_client is not None and self.by_client[addr] >= self.max_per_client:
            return APIError(503, f"{self.by_client[addr]} connections from this client address are in progress, "
                                 f"the limit per client (--max-connections-per-client); retry when one has "
                                 f"finished", "server_error", code="too_many_connections")
        return None

    def _receiver(self, scope: Scope, receive: Receive, upload: _Upload) -> Receive:
        timeout = self.body_timeout

        async def receive_timed() -> Message:
            if upload.complete or timeout is None:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), timeout)
                except asyncio.TimeoutError:
                    self._timed_out(scope, upload)
                    raise BodyTimeout(timeout, upload.received, _declared(scope)) from None
            if message["type"] == "http.request":
                upload.received += len(message.get("body", b""))
                upload.complete = upload.complete or not message.get("more_body", False)
            elif message["type"] == "http.disconnect" and not upload.started:
                upload.gone = True
            return message

        return receive_timed

    @staticmethod
    def _sender(send: Send, upload: _Upload) -> Send:
        async def send_watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                if upload.gone:
                    return  # nobody to tell (e.g. the 499 of a request whose client left)
                upload.started = True
            elif not upload.started:
                return
            await send(message)

        return send_watched

    def _timed_out(self, scope: Scope, upload: _Upload) -> None:
        self.timeout_log.info("request body timed out (%g s without a byte): %s %s, after %d%s bytes",
                              self.body_timeout, scope.get("method", ""), scope.get("path", ""), upload.received,
                              _of_declared(scope))


def _declared(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def _of_declared(scope: Scope) -> str:
    declared = _declared(scope)
    return f" of {declared}" if declared is not None else ""
