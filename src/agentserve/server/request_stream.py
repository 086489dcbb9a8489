"""What a caller of the engine holds: `RequestStream`, the incremental outputs of
one request as an async iterator, and the errors the engine raises into it
(or from `AsyncEngine.submit`)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from agentserve.engine.llm_engine import RequestOutput
    from agentserve.engine.request import Request


class EngineError(RuntimeError):
    """The engine failed while the request was in it (the request is aborted)."""


class EngineStopped(RuntimeError):
    """The engine thread is not running (not started, shut down, or crashed)."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting for admission."""


class Aborts(Protocol):
    """Where a closed stream sends its abort (an `AsyncEngine`)."""

    def abort(self, request_id: str) -> None: ...


class RequestStream:
    """The incremental outputs of one request, as an async iterator.

    Iteration ends after the finished output; an engine failure is raised from
    `__anext__`. `close()` aborts the request if it has not finished."""

    def __init__(self, engine: Aborts, request_id: str) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self.request: Request | None = None  # set on the engine thread when added

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Abort the request unless it finished; safe to call more than once, from a finally."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)
