"""The replay client's side of the wire, shared with the other benchmarks that
talk to OpenAI-compatible servers (benchmarks/: peer_speed.py, fastpath.py): a streamed
response folded into first-token time, token times, text and usage; the
server's base URL; its model and context length from /v1/models; and the
error a failed request becomes."""

from __future__ import annotations

import json


class ReplayError(Exception):
    """A failed request (its message goes into the results)."""


async def stream_post(client, path: str, body: dict, headers: dict, acc, now):
    """POST a streamed request to `path` and feed each SSE line to `acc` (with `now()`);
    an HTTP error becomes a ReplayError with the server's message (OpenAI's and
    Anthropic's error bodies both keep it at error.message). Returns `acc`."""
    async with client.stream("POST", path, json=body, headers=headers) as r:
        if r.status_code >= 400:
            raise ReplayError(http_error(r.status_code, (await r.aread()).decode("utf-8", "replace")))
        acc.replica = r.headers.get("x-agentserve-replica")  # which replica of a cluster answered
        async for line in r.aiter_lines():
            acc.feed(line, now())
    return acc


def http_error(status: int, text: str) -> str:
    """A failed request's error text: the status and the server's message."""
    try:
        text = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        pass
    return f"HTTP {status}: {str(text)[:300]}"


class StreamAccumulator:
    """Folds an OpenAI chat-completions or completions SSE stream, a line at a time (`feed`; an
    error event raises ReplayError): first-token time, the time of every chunk that carried tokens
    (a chat delta with content or tool calls; any /v1/completions chunk but an empty one with the
    finish reason after others, as llama-cpp-python ends), text, usage."""

    def __init__(self, t_send: float) -> None:
        self.t_send = t_send
        self.t_first: float | None = None
        self.token_times: list[float] = []  # one per chunk that carried tokens
        self.parts: list[str] = []
        self.usage: dict = {}
        self.done = False
        self.finish_reason: str | None = None
        self.replica: str | None = None  # `agentserve cluster`'s X-Agentserve-Replica, if sent

    def feed(self, line: str, now: float) -> None:
        chunk = sse_data(line)
        if chunk is None:
            self.done = self.done or (line.startswith("data:") and line[5:].strip() == "[DONE]")
            return
        if chunk.get("error"):
            raise error_event(chunk["error"])
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for ch in chunk.get("choices") or ():
            if "delta" in ch or "text" not in ch:  # chat completions
                delta = ch.get("delta") or {}
                piece = delta.get("content")
                tokens = bool(piece or delta.get("tool_calls"))
            else:  # completions
                piece = ch.get("text")
                tokens = bool(piece) or not ch.get("finish_reason") or not self.token_times
            if tokens:
                self.carried(now)
            if piece:
                self.parts.append(piece)
            if ch.get("finish_reason"):
                self.finish_reason = ch["finish_reason"]

    def carried(self, now: float) -> None:
        """An event carried output tokens at `now` (the first one is the first token)."""
        if self.t_first is None:
            self.t_first = now
        self.token_times.append(now)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @staticmethod
    def tokens(u: dict) -> tuple[int, int, int]:
        """(prompt, cached, completion) tokens of a usage object, as this API names them."""
        return (int(u.get("prompt_tokens") or 0), int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
                int(u.get("completion_tokens") or 0))

    @property
    def prompt_tokens(self) -> int:
        return self.tokens(self.usage)[0]

    @property
    def cached_tokens(self) -> int:
        return self.tokens(self.usage)[1]

    @property
    def completion_tokens(self) -> int:
        return self.tokens(self.usage)[2]


def sse_data(line: str) -> dict | None:
    """The JSON of an SSE `data:` line (None for event names, comments, blank lines and [DONE])."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    return json.loads(data)


def error_event(err) -> ReplayError:
    """The failure an error event reports (OpenAI's and Anthropic's keep its text at error.message)."""
    return ReplayError(f"error event: {err.get('message', err) if isinstance(err, dict) else err}")


def base_url(url: str) -> str:
    u = url.strip().rstrip("/")
    return u[:-3] if u.endswith("/v1") else u


async def server_info(client) -> tuple[str | None, int | None]:
    """(first model id, its max_model_len) from GET /v1/models; (None, None) when unavailable."""
    try:
        r = await client.get("/v1/models")
        r.raise_for_status()
        data = r.json().get("data") or []
    except Exception:  # noqa: BLE001 - a server without /v1/models
        return None, None
    if not data:
        return None, None
    card = data[0]
    mml = card.get("max_model_len") or card.get("context_length")
    return card.get("id"), int(mml) if mml else None
