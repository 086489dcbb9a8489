"""The router's bounded memory: `LruMap` (least recently used entry dropped
past a bound) and `PrefixMemory`, which replica each prefix-chain key was last
routed to and the longest chain of a request's keys it remembers."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable


class LruMap:
    """key -> replica, at most `limit` entries; a set or get makes an entry the newest."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a memory bound must be at least 1, got {limit}")
        self.limit = limit
        self._d: OrderedDict[str, str] = OrderedDict()

    def get(self, key: str) -> str | None:
        v = self._d.get(key)
        if v is not None:
            self._d.move_to_end(key)
        return v

    def peek(self, key: str) -> str | None:
        """The entry without making it the newest."""
        return self._d.get(key)

    def set(self, key: str, replica: str) -> None:
        self._d[key] = replica
        self._d.move_to_end(key)
        if len(self._d) > self.limit:
            self._d.popitem(last=False)

    def pop(self, key: str) -> str | None:
        return self._d.pop(key, None)

    def drop_replica(self, replica: str) -> int:
        """Forget every entry that points at `replica`; how many there were."""
        gone = [k for k, v in self._d.items() if v == replica]
        for k in gone:
            del self._d[k]
        return len(gone)

    def __len__(self) -> int:
        return len(self._d)


class PrefixMemory(LruMap):
    def longest(self, keys: tuple[str, ...], usable: Callable[[str], bool]) -> tuple[str | None, int]:
        """The replica of the longest chain of `keys` remembered on a replica that is
        `usable`, and how many keys that chain is (None, 0: none). Keys chain, so
        key i remembered means the prompt up to chunk i went there."""
        for i in range(len(keys) - 1, -1, -1):
            replica = self.peek(keys[i])
            if replica is not None and usable(replica):
                return replica, i + 1
        return None, 0

    def remember(self, keys: Iterable[str], replica: str) -> None:
        for k in keys:
            self.set(k, replica)
