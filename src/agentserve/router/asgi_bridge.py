"""Run an ASGI app in-process, without a socket: its lifespan, and one HTTP
request at a time as a stream of messages.

A cluster replica serves every request through the very app `agentserve
serve` runs (validation, limits, errors, streaming: one code path), so the
ingress forwards a request's method, path, headers and body, and the replica
drives the app here and streams back what the app sends: first the response
head, then the body chunks as the app writes them.

Whoever consumes `request()` going away (the ingress's client disconnected,
Ray cancelled the stream) is the client going away for the app: it gets
`http.disconnect`, which aborts the request in the engine."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from typing import Any

_DONE = object()


class AsgiBridge:
    """Drives `app` (an ASGI 3 callable) in the current event loop."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._lifespan: asyncio.Task | None = None
        self._stop = asyncio.Event()

    async def start(self) -> None:
        """Run the app's lifespan startup; raises if the app reports a failure."""
        started: asyncio.Future = asyncio.get_running_loop().create_future()
        sent_startup = False

        async def receive() -> dict:
            nonlocal sent_startup
            if not sent_startup:
                sent_startup = True
                return {"type": "lifespan.startup"}
            await self._stop.wait()
            return {"type": "lifespan.shutdown"}

        async def send(message: dict) -> None:
            kind = message["type"]
            if kind == "lifespan.startup.complete" and not started.done():
                started.set_result(None)
            elif kind == "lifespan.startup.failed" and not started.done():
                started.set_exception(RuntimeError(message.get("message") or "the app failed to start"))

        async def run() -> None:
            try:
                await self.app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
            except BaseException as e:  # noqa: BLE001 - reported through `started`
                if not started.done():
                    started.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
                raise

        self._lifespan = asyncio.ensure_future(run())
        await started

    async def stop(self) -> None:
        """Run the app's lifespan shutdown (stops the engine)."""
        if self._lifespan is not None:
            self._stop.set()
            with contextlib.suppress(Exception):
                await self._lifespan
            self._lifespan = None

    async def request(self, method: str, path: str, query: bytes, headers: Iterable[tuple[str, str]],
                      body: bytes) -> AsyncIterator[Any]:
        """The app's answer to one request: a head dict `{"status", "headers"}` (headers as
        (name, value) string pairs), then the body as bytes chunks (never empty ones)."""
        queue: asyncio.Queue = asyncio.Queue()
        disconnected = asyncio.Event()
        body_sent = False

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await queue.put(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method.upper(), "scheme": "http", "path": path, "raw_path": path.encode(),
            "root_path": "", "query_string": query,
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {},
        }

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            finally:
                await queue.put(_DONE)

        task = asyncio.ensure_future(run())
        try:
            while True:
                message = await queue.get()
                if message is _DONE:
                    if task.done() and task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                    return
                if message["type"] == "http.response.start":
                    yield {"status": message["status"],
                           "headers": [(k.decode("latin-1"), v.decode("latin-1"))
                                       for k, v in message.get("headers", [])]}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield bytes(message["body"])
                    if not message.get("more_body", False):
                        return
        finally:
            disconnected.set()
            if not task.done():
                # let the app see the disconnect and clean up (abort the request) before cancelling it
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                    await asyncio.wait_for(asyncio.shield(task), 5.0)
                task.cancel()
