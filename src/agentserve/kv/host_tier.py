"""The host-memory tier: a second, larger pool of block slots in DRAM.

Device blocks evicted from the prefix cache are copied here (write-back on
eviction, as LMCache-style offloading does), and a later prefix match that runs
past the device-resident part reloads them instead of recomputing. The tier
only keeps the accounting; the executor performs the copies it is handed.

A slot given to a node is *pending* until the executor confirms its copy
(`confirm`): a pending slot is never matched or reloaded, and a failed copy
gives the slot back (`drop`), so the index never points at a slot that was not
written."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from agentserve.kv.prefix_index import Node, PrefixIndex


class HostTier:
    def __init__(self, num_slots: int, index: PrefixIndex) -> None:
        if num_slots < 0:
            raise ValueError("host tier size must be >= 0")
        self.num_slots = num_slots
        self.index = index
        self._free = list(range(num_slots - 1, -1, -1))
        self._lru: OrderedDict[Node, None] = OrderedDict()  # least recently used first
        self.pending: set[Node] = set()  # slot given, copy not confirmed yet
        self.num_evicted = 0
        # called with a confirmed copy's node and slot as it is evicted, before the
        # slot is freed (the disk tier spills it: kv/disk_tier.py)
        self.on_evict: Callable[[Node, int], None] | None = None

    @property
    def enabled(self) -> bool:
        return self.num_slots > 0

    @property
    def num_used(self) -> int:
        return len(self._lru)

    def store(self, node: Node, protect: frozenset[Node] | set[Node] = frozenset()) -> int | None:
        """Give `node` a host slot (evicting the least recently used entry if
        full); the caller copies the device block into it. None when disabled."""
        if not self.enabled:
            return None
        if node.host_slot is not None:
            self._lru.move_to_end(node)
            return None  # already on the host: nothing to copy
        if not self._free:
            self._evict_one(protect)
            if not self._free:
                return None
        slot = self._free.pop()
        node.host_slot = slot
        self._lru[node] = None
        self.pending.add(node)
        return slot

    def readable(self, node: Node) -> bool:
        """`node` has a host copy whose write was confirmed."""
        return node.host_slot is not None and node not in self.pending

    def confirm(self, node: Node) -> None:
        """The copy into `node`'s slot succeeded: it holds the node's KV."""
        self.pending.discard(node)

    def drop(self, node: Node) -> None:
        """Forget `node`'s host copy (its write or a read of it failed) and
        free the slot; the node is pruned if nothing else holds it."""
        if node.host_slot is None:
            return
        self.pending.discard(node)
        del self._lru[node]
        self._free.append(node.host_slot)
        node.host_slot = None
        self.index.prune(node)

    def touch(self, node: Node) -> None:
        if node.host_slot is not None:
            self._lru.move_to_end(node)

    def demote(self, node: Node) -> None:
        """`node`'s copy is dead weight: next to be evicted."""
        if node.host_slot is not None:
            self._lru.move_to_end(node, last=False)

    def _evict_one(self, protect) -> None:
        for node in self._lru:
            if node in protect:
                continue
            del self._lru[node]
            if node in self.pending:
                self.pending.discard(node)  # a queued copy into it is void (kv/copies.py)
            elif self.on_evict is not None:
                self.on_evict(node, node.host_slot)
            self._free.append(node.host_slot)
            node.host_slot = None
            self.num_evicted += 1
            self.index.prune(node)
            return

    def check_integrity(self) -> None:
        slots = [n.host_slot for n in self._lru]
        assert len(set(slots)) == len(slots), "host slot used twice"
        assert not set(slots) & set(self._free), "host slot both used and free"
        assert len(slots) + len(self._free) == self.num_slots, "host slots leaked"
        assert all(n in self._lru for n in self.pending), "a pending copy without a slot"
