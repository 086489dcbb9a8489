"""The clients of `python -m benchmarks soak`: agent programs that misbehave the way
real clients do, and the bookkeeping that says whether every request got what
it should.

Each of N workers runs programs back to back until the time is up: a program
is 2 to `max_turns` chat turns under one program id (streamed or not), a
random tool time between turns, and an explicit end on its last turn. Mixed
in, at random: a stream the client drops after a few chunks (the server must
abort it and free its KV), a program whose tool never returns (it goes quiet
for good: its pin must expire on its own), and invalid requests (each must
get a 4xx, never a 5xx). With several API keys, the workers' programs take
them in turn (several tenants, on a server that has them).

Every request ends in exactly one of: a complete answer (one finish reason,
one [DONE] for a stream, with its usage), an error (an HTTP error status or
an error event in the stream), a drop the client made on purpose, or *lost*:
none of these (the connection closed or timed out without an answer). An
answer with two finish reasons, two [DONE], two usage chunks, chunks of two
response ids, or a response id another request already got, is *duplicated*."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()
SYSTEM = "You are a careful coding agent. Think briefly, then answer in one short line."


@dataclass
class SoakConfig:
    model: str
    programs: int = 64
    duration_s: float = 1800.0
    max_turns: int = 6
    max_tokens: int = 16
    tool_s: tuple[float, float] = (0.05, 2.0)  # the tool time between turns, uniform
    p_stream: float = 0.7
    p_disconnect: float = 0.08  # a streamed turn the client drops after a few chunks
    p_quiet: float = 0.04  # after a turn, the program's tool never returns
    p_invalid: float = 0.05  # before a turn, an invalid request
    p_ttl_hint: float = 0.2  # a turn that sends a TTL hint (1-30 s)
    keys: list[str] = field(default_factory=list)  # API keys, one per tenant (empty: none)
    request_timeout_s: float = 600.0
    seed: int = 0


@dataclass
class Tally:
    requests: int = 0
    complete: int = 0
    http_errors: Counter = field(default_factory=Counter)  # status -> count, for valid requests
    error_events: int = 0  # an error event inside a stream (an engine failure)
    dropped: int = 0  # streams the client dropped on purpose
    lost: int = 0
    duplicated: int = 0
    invalid_sent: int = 0
    invalid_status: Counter = field(default_factory=Counter)  # status -> count, for invalid requests
    programs_started: int = 0
    programs_ended: int = 0
    programs_quiet: int = 0
    examples: list[str] = field(default_factory=list)  # the first lost/duplicated/5xx, for the report

    @property
    def server_errors(self) -> int:
        """Responses >= 500, to valid or invalid requests."""
        return sum(n for s, n in self.http_errors.items() if s >= 500) + \
            sum(n for s, n in self.invalid_status.items() if s >= 500)

    def note(self, what: str) -> None:
        if len(self.examples) < 20:
            self.examples.append(what)

    def as_dict(self) -> dict:
        return {"requests": self.requests, "complete": self.complete,
                "http_errors": {str(k): v for k, v in sorted(self.http_errors.items())},
                "error_events": self.error_events, "dropped_by_client": self.dropped, "lost": self.lost,
                "duplicated": self.duplicated, "server_errors": self.server_errors,
                "invalid_sent": self.invalid_sent,
                "invalid_status": {str(k): v for k, v in sorted(self.invalid_status.items())},
                "programs_started": self.programs_started, "programs_ended": self.programs_ended,
                "programs_quiet": self.programs_quiet, "examples": self.examples}


class StreamCheck:
    """One streamed response's events, folded: text, and what it ended with."""

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self.finishes = 0
        self.dones = 0
        self.usages = 0
        self.errors = 0
        self.chunks = 0
        self.text: list[str] = []

    def feed(self, line: str) -> None:
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.dones += 1
            return
        if not data:
            return
        obj = json.loads(data)
        if "error" in obj:
            self.errors += 1
            return
        self.chunks += 1
        if obj.get("id"):
            self.ids.add(obj["id"])
        if obj.get("usage"):
            self.usages += 1
        for c in obj.get("choices") or ():
            self.text.append((c.get("delta") or {}).get("content") or "")
            if c.get("finish_reason"):
                self.finishes += 1

    @property
    def duplicated(self) -> bool:
        return self.finishes > 1 or self.dones > 1 or self.usages > 1 or len(self.ids) > 1 or self.errors > 1

    def outcome(self) -> str:
        """'duplicated', 'error', 'complete' or 'lost'."""
        if self.duplicated:
            return "duplicated"
        if self.errors:
            return "error"
        if self.finishes == 1 and self.dones == 1 and self.usages == 1:
            return "complete"
        return "lost"


def invalid_requests(model: str) -> list[tuple[str, bytes | dict, str]]:
    """(path, body, what) of requests a server must refuse with a 4xx."""
    msgs = [{"role": "user", "content": "hi"}]
    return [
        ("/v1/chat/completions", b'{"model": "x", "messages": [', "truncated JSON"),
        ("/v1/chat/completions", b"\xff\xfe not json", "bytes that are not UTF-8"),
        ("/v1/chat/completions", {"model": model, "messages": "hello"}, "messages not a list"),
        ("/v1/chat/completions", {"model": "no-such-model", "messages": msgs}, "unknown model"),
        ("/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": -5}, "negative max_tokens"),
        ("/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 10**9}, "max_tokens too large"),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "wizard", "content": "x"}]}, "bad role"),
        ("/v1/chat/completions", {"model": model, "messages": msgs, "n": 3}, "n > 1"),
        ("/v1/completions", {"model": model}, "completion without a prompt"),
        ("/v1/chat/completions", {"model": model, "messages": msgs, "program_id": "p" * 5000}, "program id too long"),
    ]


class SoakClients:
    def __init__(self, cfg: SoakConfig, client: httpx.AsyncClient, tag: str) -> None:
        self.cfg = cfg
        self.client = client
        self.tag = tag  # keeps program ids of different runs apart
        self.tally = Tally()
        self.response_ids: set[str] = set()
        self.quiet: list[str] = []  # program ids that went quiet, for the report
        self._invalid = invalid_requests(cfg.model)

    def _headers(self, worker: int, extra: dict | None = None) -> dict:
        h = dict(extra or {})
        if self.cfg.keys:
            h["Authorization"] = f"Bearer {self.cfg.keys[worker % len(self.cfg.keys)]}"
        return h

    def _seen(self, rid: str | None, what: str) -> bool:
        """Record a response id; True when another request already got it (a duplicate)."""
        if not rid:
            return False
        if rid in self.response_ids:
            self.tally.duplicated += 1
            self.tally.note(f"response id {rid} given twice ({what})")
            return True
        self.response_ids.add(rid)
        return False

    async def run(self, deadline: float) -> None:
        await asyncio.gather(*(self._worker(i, deadline) for i in range(self.cfg.programs)))

    async def _worker(self, i: int, deadline: float) -> None:
        rng = random.Random(f"{self.cfg.seed}-{i}")
        k = 0
        while time.monotonic() < deadline:
            await self._program(i, f"soak-{self.tag}-{i}-{k}", rng, deadline)
            k += 1

    async def _program(self, worker: int, pid: str, rng: random.Random, deadline: float) -> None:
        cfg, t = self.cfg, self.tally
        t.programs_started += 1
        task = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Task {pid}: {task}"}]
        turns = rng.randint(2, cfg.max_turns)
        for n in range(turns):
            if rng.random() < cfg.p_invalid:
                await self._invalid_request(worker, rng)
            last = n == turns - 1 or time.monotonic() >= deadline
            reply = await self._turn(worker, pid, msgs, rng, last)
            if last:
                t.programs_ended += 1
                return
            if reply is not None:
                msgs.append({"role": "assistant", "content": reply})
            msgs.append({"role": "user", "content": "Tool output: " + " ".join(rng.choice(WORDS) for _ in range(6))})
            if rng.random() < cfg.p_quiet:  # the tool never returns: nothing more comes from this program
                t.programs_quiet += 1
                self.quiet.append(pid)
                return
            await asyncio.sleep(rng.uniform(*cfg.tool_s))

    async def _turn(self, worker: int, pid: str, msgs: list[dict], rng: random.Random, last: bool) -> str | None:
        """One turn; the reply's text, or None when it got none."""
        cfg, t = self.cfg, self.tally
        body: dict = {"model": cfg.model, "messages": msgs, "max_tokens": cfg.max_tokens,
                      "temperature": rng.choice((0.0, 0.7)), "seed": rng.randrange(2**31)}
        extra = {"X-Program-Id": pid}
        if last:
            extra["X-Program-End"] = "true"
        elif rng.random() < cfg.p_ttl_hint:
            body["ttl"] = round(rng.uniform(1.0, 30.0), 1)
        headers = self._headers(worker, extra)
        t.requests += 1
        try:
            if rng.random() < cfg.p_stream:
                drop = None if last or rng.random() >= cfg.p_disconnect else rng.randint(1, 4)
                return await self._streamed(body, headers, pid, drop)
            return await self._whole(body, headers, pid)
        except (httpx.TransportError, json.JSONDecodeError) as e:  # closed, reset or timed out: no answer
            t.lost += 1
            t.note(f"{pid}: {type(e).__name__}: {str(e)[:200]}")
            return None

    async def _whole(self, body: dict, headers: dict, pid: str) -> str | None:
        t = self.tally
        r = await self.client.post("/v1/chat/completions", json=body, headers=headers)
        if r.status_code != 200:
            return self._http_error(r.status_code, r.text, pid)
        obj = r.json()
        choices = obj.get("choices") or []
        if len(choices) != 1 or not choices[0].get("finish_reason"):
            t.lost += 1
            t.note(f"{pid}: a 200 without one finished choice: {r.text[:200]}")
            return None
        if not self._seen(obj.get("id"), pid):
            t.complete += 1
        return choices[0]["message"].get("content") or ""

    async def _streamed(self, body: dict, headers: dict, pid: str, drop: int | None) -> str | None:
        t = self.tally
        body = dict(body, stream=True, stream_options={"include_usage": True})
        check = StreamCheck()
        async with self.client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                return self._http_error(r.status_code, (await r.aread()).decode("utf-8", "replace"), pid)
            async for line in r.aiter_lines():
                check.feed(line)
                if drop is not None and check.chunks >= drop:
                    t.dropped += 1  # leaving the block closes the connection mid-stream
                    return None
        outcome = check.outcome()  # (a stream shorter than the chunk it was to be dropped at ends as usual)
        if outcome == "complete":
            if not self._seen(next(iter(check.ids), None), pid):
                t.complete += 1
            return "".join(check.text)
        if outcome == "error":
            t.error_events += 1
        elif outcome == "duplicated":
            t.duplicated += 1
            t.note(f"{pid}: duplicated stream (finishes {check.finishes}, [DONE] {check.dones}, usage "
                   f"{check.usages}, ids {len(check.ids)})")
        else:
            t.lost += 1
            t.note(f"{pid}: stream ended without an answer (finishes {check.finishes}, [DONE] {check.dones}, "
                   f"usage {check.usages})")
        return None

    def _http_error(self, status: int, text: str, pid: str) -> None:
        self.tally.http_errors[status] += 1
        if status >= 500:
            self.tally.note(f"{pid}: HTTP {status}: {text[:200]}")

    async def _invalid_request(self, worker: int, rng: random.Random) -> None:
        path, body, what = rng.choice(self._invalid)
        t = self.tally
        t.invalid_sent += 1
        headers = self._headers(worker, {"Content-Type": "application/json"})
        try:
            if isinstance(body, bytes):
                r = await self.client.post(path, content=body, headers=headers)
            else:
                r = await self.client.post(path, json=body, headers=headers)
        except httpx.TransportError as e:
            t.lost += 1
            t.note(f"invalid request ({what}): {type(e).__name__}: {e}")
            return
        t.invalid_status[r.status_code] += 1
        if not 400 <= r.status_code < 500:
            t.note(f"invalid request ({what}) got HTTP {r.status_code}: {r.text[:200]}")
