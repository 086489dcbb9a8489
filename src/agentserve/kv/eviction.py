"""Eviction strategies: which evictable cached block to reuse next.

The block pool hands a strategy every cached block whose reference count
drops to zero (`add`), takes back blocks that a prefix hit revives
(`remove`), and asks for a victim when it needs a block (`pop`). Blocks that
hold no cached content never reach a strategy: the pool reuses those first."""

from __future__ import annotations

import abc
from typing import ClassVar

from agentserve.kv.block import Block


class EvictionStrategy(abc.ABC):
    name: ClassVar[str]

    @abc.abstractmethod
    def add(self, block: Block, now: float) -> None:
        """`block` (cached, ref_cnt == 0) became evictable."""

    @abc.abstractmethod
    def remove(self, block: Block) -> None:
        """`block` is no longer evictable (a prefix hit took a reference)."""

    @abc.abstractmethod
    def pop(self) -> Block:
        """Remove and return the victim. IndexError when empty."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    def __contains__(self, block: Block) -> bool:
        return block.strategy_data is self

    # Optional hooks (no-ops by default).
    def on_children_changed(self, block: Block) -> None:
        """`block.num_children` changed (a child was cached or evicted)."""

    def on_insert(self, block: Block) -> None:
        """`block` was just registered in the prefix index (it is in use)."""

    def on_hit(self, block: Block) -> None:
        """A prefix match hit `block` (block.hits was already incremented)."""


class _LinkedList:
    """Intrusive doubly linked list over Block.prev/next: O(1) append, unlink, popleft."""

    __slots__ = ("head", "tail", "size", "owner")

    def __init__(self, owner: object) -> None:
        self.head: Block | None = None
        self.tail: Block | None = None
        self.size = 0
        self.owner = owner

    def append(self, b: Block) -> None:
        b.prev, b.next = self.tail, None
        if self.tail is None:
            self.head = b
        else:
            self.tail.next = b
        self.tail = b
        self.size += 1
        b.strategy_data = self.owner

    def unlink(self, b: Block) -> None:
        if b.prev is None:
            self.head = b.next
        else:
            b.prev.next = b.next
        if b.next is None:
            self.tail = b.prev
        else:
            b.next.prev = b.prev
        b.prev = b.next = None
        b.strategy_data = None
        self.size -= 1

    def popleft(self) -> Block:
        b = self.head
        if b is None:
            raise IndexError("no evictable block")
        self.unlink(b)
        return b

    def __iter__(self):
        b = self.head
        while b is not None:
            yield b
            b = b.next


class LRU(EvictionStrategy):
    """Least recently freed first (vLLM's free-queue order)."""

    name = "lru"

    def __init__(self) -> None:
        self._list = _LinkedList(self)

    def add(self, block: Block, now: float) -> None:
        self._list.append(block)

    def remove(self, block: Block) -> None:
        self._list.unlink(block)

    def pop(self) -> Block:
        return self._list.popleft()

    def __len__(self) -> int:
        return self._list.size


STRATEGIES: dict[str, type[EvictionStrategy]] = {LRU.name: LRU}


def make_strategy(name: str) -> EvictionStrategy:
    try:
        return STRATEGIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction strategy {name!r}; choose from {', '.join(sorted(STRATEGIES))}") from None
