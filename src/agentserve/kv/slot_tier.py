"""A tier of block slots below the device (host memory, disk): the accounting
both share. A node of the prefix index holds its slot in the tier's own
attribute (`Node.host_slot`, `Node.disk_slot`); the tier keeps the free slots,
the LRU order of the used ones and the slots whose copy is still *pending*.

A slot given to a node is pending until the executor confirms its copy
(`confirm`): a pending slot is never matched or read, and a failed copy gives
the slot back (`drop`), so the index never points at a slot that was not
written. An evicted slot's node is pruned if nothing else holds it; a
confirmed copy being evicted is first offered to `on_evict` (the host tier
spills it to the disk tier)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import ClassVar

from agentserve.kv.prefix_index import Node, PrefixIndex


class SlotTier:
    name: ClassVar[str]  # for errors: "host", "disk"
    slot_attr: ClassVar[str]  # the Node attribute that holds a node's slot in this tier

    def __init__(self, num_slots: int, index: PrefixIndex) -> None:
        if num_slots < 0:
            raise ValueError(f"{self.name} tier size must be >= 0")
        self.num_slots = num_slots
        self.index = index
        self._free = list(range(num_slots - 1, -1, -1))
        self._lru: OrderedDict[Node, None] = OrderedDict()  # least recently used first
        self.pending: set[Node] = set()  # slot given, copy not confirmed yet
        self.dead: set[Node] = set()  # demoted as read by no turn again: not offered to on_evict
        self.num_evicted = 0
        self.num_stored = 0  # slots given to nodes, ever (how fast the tier turns over)
        # called with a confirmed copy's node and slot as it is evicted, before the slot is freed
        self.on_evict: Callable[[Node, int], None] | None = None
        # called with a node as it loses its slot (dropped or evicted): the slots
        # lent for it (`take_slots`) go back too
        self.on_forget: Callable[[Node], None] | None = None
        self.num_lent = 0  # slots lent beside the nodes' own (kv/window_tier.py: window parts' copies)
        # nodes whose copy a disk -> host stage reads or writes (kv/stage_copies.py): never evicted meanwhile
        self.held: set[Node] = set()
        # nodes whose part copy a reload into their block on the device reads (kv/window_tier.py): the same
        self.reading: set[Node] = set()

    @property
    def enabled(self) -> bool:
        return self.num_slots > 0

    @property
    def num_used(self) -> int:
        return len(self._lru) + self.num_lent

    def slot(self, node: Node) -> int | None:
        return getattr(node, self.slot_attr)

    def store(self, node: Node, protect: frozenset[Node] | set[Node] = frozenset()) -> int | None:
        """Give `node` a slot (evicting the least recently used entry not in
        `protect` if full); the caller copies the block into it. None when
        disabled, already held (nothing to copy) or nothing is evictable."""
        if not self.enabled:
            return None
        if self.slot(node) is not None:
            self._lru.move_to_end(node)
            self.dead.discard(node)
            return None
        if not self._free:
            self._evict_one(protect)
            if not self._free:
                return None
        slot = self._free.pop()
        self.num_stored += 1
        setattr(node, self.slot_attr, slot)
        self._lru[node] = None
        self.pending.add(node)
        return slot

    def take_slots(self, n: int, protect: frozenset[Node] | set[Node] = frozenset()) -> list[int] | None:
        """Lend `n` free slots (evicting least recently used entries not in
        `protect` to make room); the borrower gives them back (`give_back`), at
        the latest when `on_forget` tells it their node lost its own slot. None
        when eviction cannot make room."""
        while len(self._free) < n:
            before = len(self._free)
            self._evict_one(protect)
            if len(self._free) == before:
                return None
        self.num_lent += n
        return [self._free.pop() for _ in range(n)]

    def give_back(self, slots: list[int]) -> None:
        self._free.extend(slots)
        self.num_lent -= len(slots)

    def check_lent(self, slots: list[int]) -> None:
        """`slots`: every slot lent out (`take_slots`), as their borrowers hold them."""
        assert len(slots) == self.num_lent, f"{self.num_lent} {self.name} slots lent, {len(slots)} held"
        assert len(set(slots)) == len(slots), f"a lent {self.name} slot held twice"
        assert not set(slots) & (set(self._free) | {self.slot(n) for n in self._lru}), \
            f"a lent {self.name} slot is also free or a node's"

    def readable(self, node: Node) -> bool:
        """`node` has a copy here whose write was confirmed."""
        return self.slot(node) is not None and node not in self.pending

    def confirm(self, node: Node) -> None:
        """The copy into `node`'s slot succeeded: it holds the node's KV."""
        self.pending.discard(node)

    def drop(self, node: Node) -> None:
        """Forget `node`'s copy (its write or a read of it failed) and free the
        slot; the node is pruned if nothing else holds it."""
        slot = self.slot(node)
        if slot is None:
            return
        self.pending.discard(node)
        self.dead.discard(node)
        del self._lru[node]
        self._free.append(slot)
        setattr(node, self.slot_attr, None)
        if self.on_forget is not None:
            self.on_forget(node)
        self.index.prune(node)

    def touch(self, node: Node) -> None:
        if self.slot(node) is not None:
            self._lru.move_to_end(node)
            self.dead.discard(node)

    def demote(self, node: Node, dead: bool = False) -> None:
        """`node`'s copy is next to be evicted: it waits long (and goes on to the
        tier below first), or, `dead`, no turn will read it again (and it goes
        nowhere)."""
        if self.slot(node) is not None:
            self._lru.move_to_end(node, last=False)
            if dead:
                self.dead.add(node)

    def _evict_one(self, protect) -> None:
        # A confirmed copy goes before a pending one: evicting a copy in flight
        # wastes its write (and a demoted one would never reach the tier below).
        held, reading = self.held, self.reading
        victim = next((n for n in self._lru if n not in protect and n not in self.pending and n not in held
                       and n not in reading), None)
        if victim is None:
            victim = next((n for n in self._lru if n not in protect and n not in held and n not in reading), None)
        if victim is None:
            return
        del self._lru[victim]
        slot = self.slot(victim)
        if victim in self.pending:
            self.pending.discard(victim)  # a queued copy into it is void
        elif self.on_evict is not None and victim not in self.dead:
            self.on_evict(victim, slot)
        self.dead.discard(victim)
        self._free.append(slot)
        setattr(victim, self.slot_attr, None)
        if self.on_forget is not None:
            self.on_forget(victim)
        self.num_evicted += 1
        self.index.prune(victim)

    def check_integrity(self) -> None:
        slots = [self.slot(n) for n in self._lru]
        assert len(set(slots)) == len(slots), f"{self.name} slot used twice"
        assert not set(slots) & set(self._free), f"{self.name} slot both used and free"
        assert len(slots) + len(self._free) + self.num_lent == self.num_slots, f"{self.name} slots leaked"
        assert all(n in self._lru for n in self.pending), "a pending copy without a slot"
        assert all(n in self._lru for n in self.dead), "a dead copy without a slot"
