"""Eviction strategies: which evictable cached block to reuse next.

The block pool hands a strategy every cached block whose reference count
drops to zero (`add`), takes back blocks that a prefix hit revives
(`remove`), and asks for a victim when it needs a block (`pop`). Blocks that
hold no cached content never reach a strategy: the pool reuses those first."""

from __future__ import annotations

import abc
import heapq
from collections import OrderedDict
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

    def peek(self) -> Block | None:
        """The block `pop` would return, where the strategy orders by recency
        (None: it does not say, or it is empty). The hybrid cache's window
        parts interleave with it by the time they were freed (kv/window_parts.py)."""
        return None

    # Optional hooks (no-ops by default).
    def on_children_changed(self, block: Block) -> None:
        """`block.num_children` changed (a child was cached or evicted)."""

    def on_insert(self, block: Block) -> None:
        """`block` was just registered in the prefix index (it is in use)."""

    def on_hit(self, block: Block) -> None:
        """A prefix match hit `block` (block.hits was already incremented)."""


class LinkedList:
    """Intrusive doubly linked list over Block.prev/next: O(1) append, unlink, popleft.

    A member's `strategy_data` is `owner` (the list itself when no owner is
    given), so a strategy with several lists can tell which one holds a block."""

    __slots__ = ("head", "tail", "size", "owner")

    def __init__(self, owner: object = None) -> None:
        self.head: Block | None = None
        self.tail: Block | None = None
        self.size = 0
        self.owner = self if owner is None else owner

    def append(self, b: Block) -> None:
        b.prev, b.next = self.tail, None
        if self.tail is None:
            self.head = b
        else:
            self.tail.next = b
        self.tail = b
        self.size += 1
        b.strategy_data = self.owner

    def appendleft(self, b: Block) -> None:
        b.prev, b.next = None, self.head
        if self.head is None:
            self.tail = b
        else:
            self.head.prev = b
        self.head = b
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

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        b = self.head
        while b is not None:
            yield b
            b = b.next


class LRU(EvictionStrategy):
    """Least recently freed first (vLLM's free-queue order)."""

    name = "lru"

    def __init__(self, capacity: int | None = None) -> None:
        # `capacity` (the pool size) is accepted so the pool can build any
        # strategy the same way; LRU needs no bound.
        self._list = LinkedList(self)

    def add(self, block: Block, now: float) -> None:
        self._list.append(block)

    def remove(self, block: Block) -> None:
        self._list.unlink(block)

    def pop(self) -> Block:
        return self._list.popleft()

    def peek(self) -> Block | None:
        return self._list.head

    def __len__(self) -> int:
        return self._list.size


class LeafLRU(EvictionStrategy):
    """LRU over leaves first: evict the least recently freed evictable block
    with no cached children; only when no evictable leaf exists, the least
    recently freed inner block. A shared prefix thus outlives every suffix
    hanging off it. A free block that becomes a leaf (its last cached child
    was evicted) goes to the oldest end of the leaves, so a dead chain keeps
    draining from its tail before a live program's newest blocks are touched
    (appending it instead cost 3-10 points of hit ratio against plain LRU in
    `python -m benchmarks apc`); one that gains a child goes to the newest end of
    the inner list. All operations O(1)."""

    name = "leaf-lru"

    def __init__(self, capacity: int | None = None) -> None:
        self._leaves = LinkedList()
        self._inner = LinkedList()

    def _list_for(self, block: Block) -> LinkedList:
        return self._leaves if block.num_children == 0 else self._inner

    def add(self, block: Block, now: float) -> None:
        self._list_for(block).append(block)

    def remove(self, block: Block) -> None:
        lst = block.strategy_data
        if lst is not self._leaves and lst is not self._inner:
            raise KeyError(block)
        lst.unlink(block)

    def pop(self) -> Block:
        if self._leaves.size:
            return self._leaves.popleft()
        return self._inner.popleft()  # IndexError when both are empty

    def peek(self) -> Block | None:
        return self._leaves.head if self._leaves.size else self._inner.head

    def __len__(self) -> int:
        return self._leaves.size + self._inner.size

    def __contains__(self, block: Block) -> bool:
        lst = block.strategy_data
        return lst is self._leaves or lst is self._inner

    def on_children_changed(self, block: Block) -> None:
        lst = block.strategy_data
        if lst is not self._leaves and lst is not self._inner:
            return  # in use: placed by add() when it is freed
        target = self._list_for(block)
        if target is not lst:
            lst.unlink(block)
            if target is self._leaves:
                target.appendleft(block)
            else:
                target.append(block)


class LFU(EvictionStrategy):
    """Fewest prefix hits first (`block.hits`), ties by least recently freed.

    A binary heap of `(hits, free_seq, block)` entries with lazy invalidation:
    `_live` maps each evictable block to its one current entry, so entries
    left behind by remove() (or by a re-add, which pushes a fresh entry) are
    skipped by pop(). The heap is rebuilt when stale entries outnumber live
    ones. add/pop/on_hit O(log n) amortized, remove O(1)."""

    name = "lfu"

    def __init__(self, capacity: int | None = None) -> None:
        self._heap: list[tuple[int, int, Block]] = []
        self._live: dict[Block, tuple[int, int, Block]] = {}
        self._seq = 0

    def _push(self, entry: tuple[int, int, Block]) -> None:
        self._live[entry[2]] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)

    def add(self, block: Block, now: float) -> None:
        self._seq += 1
        block.strategy_data = self
        self._push((block.hits, self._seq, block))

    def remove(self, block: Block) -> None:
        del self._live[block]  # KeyError when not evictable
        block.strategy_data = None

    def pop(self) -> Block:
        heap, live = self._heap, self._live
        while heap:
            entry = heapq.heappop(heap)
            block = entry[2]
            if live.get(block) is entry:
                del live[block]
                block.strategy_data = None
                return block
        raise IndexError("no evictable block")

    def __len__(self) -> int:
        return len(self._live)

    def on_hit(self, block: Block) -> None:
        # The pool normally revives (remove) a block before counting a hit;
        # if an evictable block's count changes anyway, re-key it, keeping its
        # place among equals.
        entry = self._live.get(block)
        if entry is not None and entry[0] != block.hits:
            self._push((block.hits, entry[1], block))


class ARC(EvictionStrategy):
    """Adaptive Replacement Cache over evictable blocks.

    T1 holds evictable blocks hit at most once since cached (recency), T2 those
    hit more often (frequency); both are LRU lists. pop() takes T1's oldest
    while |T1| > p, else T2's oldest, and remembers the victim's key in ghost
    list B1 or B2 (each at most `capacity` keys). When on_insert() re-caches a
    key found in B1, T1 evicted too eagerly: p += max(1, |B2|/|B1|); a key found
    in B2 means T2 did: p -= max(1, |B1|/|B2|); p stays within [0, capacity].
    """

    name = "arc"

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = 4096 if capacity is None else int(capacity)
        if self.capacity < 1:
            raise ValueError("ARC capacity must be >= 1")
        self.p = 0.0  # target |T1|
        self._t1 = LinkedList()
        self._t2 = LinkedList()
        self._b1: OrderedDict[int, None] = OrderedDict()
        self._b2: OrderedDict[int, None] = OrderedDict()

    def _list_for(self, block: Block) -> LinkedList:
        return self._t1 if block.hits <= 1 else self._t2

    def add(self, block: Block, now: float) -> None:
        self._list_for(block).append(block)

    def remove(self, block: Block) -> None:
        lst = block.strategy_data
        if lst is not self._t1 and lst is not self._t2:
            raise KeyError(block)
        lst.unlink(block)

    def pop(self) -> Block:
        t1, t2 = self._t1, self._t2
        if t1.size and (t1.size > self.p or not t2.size):
            block, ghost, other = t1.popleft(), self._b1, self._b2
        else:
            block, ghost, other = t2.popleft(), self._b2, self._b1  # IndexError when empty
        key = block.key
        if key is not None:
            other.pop(key, None)
            ghost[key] = None
            ghost.move_to_end(key)
            if len(ghost) > self.capacity:
                ghost.popitem(last=False)
        return block

    def __len__(self) -> int:
        return self._t1.size + self._t2.size

    def __contains__(self, block: Block) -> bool:
        lst = block.strategy_data
        return lst is self._t1 or lst is self._t2

    def on_insert(self, block: Block) -> None:
        key = block.key
        b1, b2 = self._b1, self._b2
        if key in b1:
            self.p = min(float(self.capacity), self.p + max(1.0, len(b2) / len(b1)))
            del b1[key]
        elif key in b2:
            self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
            del b2[key]

    def on_hit(self, block: Block) -> None:
        # Normally the block is in use here; if it is evictable, promote it.
        lst = block.strategy_data
        if (lst is self._t1 or lst is self._t2) and self._list_for(block) is not lst:
            lst.unlink(block)
            self._list_for(block).append(block)


STRATEGIES: dict[str, type[EvictionStrategy]] = {
    cls.name: cls for cls in (LRU, LeafLRU, LFU, ARC)
}


def make_strategy(name: str, **kwargs) -> EvictionStrategy:
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction strategy {name!r}; choose from {', '.join(sorted(STRATEGIES))}") from None
    return cls(**kwargs)
