"""The stored responses of the Responses API (`store`, `previous_response_id`,
GET/DELETE /v1/responses/{id}, its input_items), in this process's memory only:
a restart forgets them all, and a later `previous_response_id` of a forgotten
response is a 404 `previous_response_not_found`.

A stored response keeps only what it added: its own input items and its own
output items, and a link to the response it continued. The conversation a
continuation renders is the walk up those links (`conversation`), so a long
chain costs its items once, not once per turn. Each response also keeps the
program its chain names (identity.py), so a continuation is scheduled as that
program without any header.

The store is bounded by a number of responses and by bytes (the JSON of what
each keeps), and evicts the least recently used response (a GET, a listing
and a continuation use it; a continuation also uses every ancestor, the
oldest counting as least recent). An evicted response can no longer be
retrieved or continued, but the responses that continue it still hold it, so
their chains stay whole; its bytes count until the last of them is gone, so
the byte bound holds for all memory the store keeps (a single conversation
larger than it is not kept at all). Keys are scoped by tenant: another
tenant's id is exactly as unknown as one never issued."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 10_000
DEFAULT_MAX_BYTES = 256 * 2**20
_UNITS = {"": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30}


def parse_store_max(text: str) -> tuple[int, int]:
    """`COUNT` or `COUNT,BYTES` (BYTES may end in KiB, MiB or GiB): the store's bounds;
    a missing BYTES is the default. Raises ValueError with a readable message."""
    count_s, _, bytes_s = text.partition(",")
    try:
        count = int(count_s.strip())
    except ValueError:
        raise ValueError(f"--responses-store-max: COUNT must be an integer, got {count_s.strip()!r}") from None
    size = DEFAULT_MAX_BYTES
    if bytes_s.strip():
        m = re.fullmatch(r"(\d+)\s*([a-zA-Z]*)", bytes_s.strip())
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"--responses-store-max: BYTES must be a number of bytes, optionally with KiB, MiB "
                             f"or GiB, got {bytes_s.strip()!r}")
        size = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if count < 0 or size < 0:
        raise ValueError("--responses-store-max: the bounds must be >= 0")
    return count, size


@dataclass(eq=False)
class StoredResponse:
    id: str
    body: dict[str, Any]  # the response object, as GET returns it
    input_items: list[dict[str, Any]]  # what this request added (ids assigned), in order
    output_items: list[dict[str, Any]]
    previous: StoredResponse | None  # the response it continues
    program: str | None  # the client's (unscoped) program id its chain names
    size: int = 0
    refs: int = 0  # 1 while retrievable, plus one per kept response that continues it

    def conversation(self) -> list[dict[str, Any]]:
        """Every item of the chain up to and including this response's output, oldest first."""
        chain = []
        at: StoredResponse | None = self
        while at is not None:
            chain.append(at)
            at = at.previous
        return [item for e in reversed(chain) for item in (*e.input_items, *e.output_items)]


class ResponseNotFound(KeyError):
    """A response is not in the store: never stored, evicted, deleted, or another tenant's."""


class ResponsesStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """What the kept responses take, evicted ancestors of kept ones included."""
        return self._bytes

    def get(self, scope: str | None, rid: str) -> StoredResponse:
        with self._lock:
            e = self._entries.get((scope, rid))
            if e is None:
                raise ResponseNotFound(rid)
            self._entries.move_to_end((scope, rid))
            return e

    def continue_from(self, scope: str | None, rid: str) -> StoredResponse:
        """The response a request continues; it and its retrievable ancestors count as used."""
        with self._lock:
            e = self._entries.get((scope, rid))
            if e is None:
                raise ResponseNotFound(rid)
            chain = []
            at: StoredResponse | None = e
            while at is not None:
                chain.append(at)
                at = at.previous
            for a in reversed(chain):  # the oldest is the least recent of them
                if (scope, a.id) in self._entries:
                    self._entries.move_to_end((scope, a.id))
            return e

    def put(self, scope: str | None, entry: StoredResponse) -> None:
        entry.size = len(json.dumps([entry.body, entry.input_items, entry.output_items], ensure_ascii=False))
        with self._lock:
            self._retain(entry)
            self._entries[(scope, entry.id)] = entry
            while self._entries and (len(self._entries) > self.max_responses or self._bytes > self.max_bytes):
                _, old = self._entries.popitem(last=False)
                self._release(old)
                self.evicted += 1

    def delete(self, scope: str | None, rid: str) -> bool:
        with self._lock:
            e = self._entries.pop((scope, rid), None)
            if e is None:
                return False
            self._release(e)
            return True

    def _retain(self, e: StoredResponse | None) -> None:
        """One more reference to `e`; a response no longer counted (its chain was evicted
        while a continuation of it ran) counts again, with its ancestors."""
        while e is not None:
            e.refs += 1
            if e.refs > 1:
                return
            self._bytes += e.size
            e = e.previous

    def _release(self, e: StoredResponse | None) -> None:
        """One reference to `e` is gone; when none is left its bytes are free, and its parent loses one."""
        while e is not None:
            e.refs -= 1
            if e.refs > 0:
                return
            self._bytes -= e.size
            e = e.previous
