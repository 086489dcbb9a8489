"""Disk -> host stages: a block whose KV is only on disk copied into a host
slot ahead of its program's predicted turn (engine/prefetch.py), so that the
turn's reload is the fast host copy, and the slow disk read is off its
critical path. A stage takes no device block, only a host slot.

A staged node's host slot is pending until the executor confirms the read (as
any tier copy, kv/copies.py): until then it is not matched through either
tier (the turn it was staged for waits for it), and neither its disk slot (the
stage reads it) nor its host slot (the stage writes it) is evicted
(`SlotTier.held`). Confirmed, the node has both copies; a failed read drops
both (the disk file is not trusted again, as a failed disk reload drops it).
The executor runs stages on the disk link, after the batch's disk reloads."""

from __future__ import annotations

from collections.abc import Iterable

from agentserve.kv.copies import CopyQueue
from agentserve.kv.disk_tier import DiskCopies, DiskTier
from agentserve.kv.host_tier import HostTier
from agentserve.kv.prefix_index import Node


class StageCopies:
    def __init__(self, host: HostTier, disk: DiskTier, copies: CopyQueue, disk_copies: DiskCopies) -> None:
        self.host = host
        self.disk = disk
        self.copies = copies
        self.disk_copies = disk_copies
        self.staging: set[Node] = set()  # queued or in flight
        host.held = disk.held = self.staging
        self.stages: list[tuple[int, int]] = []  # (disk slot, host slot), queued
        self._nodes: list[Node] = []
        self._inflight: dict[int, list[Node]] = {}  # ticket -> the nodes of its stages
        self._auto = 0
        self.num_staged = 0  # stages confirmed
        self.num_failed = 0

    @property
    def num_inflight(self) -> int:
        """Batches of stages taken and not finished yet."""
        return len(self._inflight)

    def stageable(self, node: Node) -> bool:
        """`node` has KV only on disk (confirmed), and no copy of it is under way."""
        return (node.block is None and node.host_slot is None and self.disk.readable(node)
                and node not in self.staging and node not in self.disk_copies.loading)

    def stage(self, nodes: Iterable[Node]) -> list[Node]:
        """Queue a stage of each of `nodes` (each `stageable`) into a host slot;
        returns those queued (a full host tier whose every slot is in use by a
        copy under way gives none)."""
        nodes = list(nodes)
        # first: the spills the host slots may cause must not evict their disk copies
        self.staging.update(nodes)
        out = []
        for node in nodes:
            slot = self.host.store(node, self.copies.loading)
            if slot is None:
                break
            self.stages.append((node.disk_slot, slot))
            self._nodes.append(node)
            self.disk.touch(node)
            out.append(node)
        self.staging.difference_update(nodes[len(out):])
        return out

    def take(self, ticket: int | None = None) -> list[tuple[int, int]]:
        """The stages queued since the last call, as the batch `ticket` (kv/copies.py)."""
        if ticket is None:
            self._auto -= 1
            ticket = self._auto
        if ticket in self._inflight:
            raise RuntimeError(f"stages under ticket {ticket} are still in flight")
        out = self.stages
        if out:
            self._inflight[ticket] = self._nodes
        self.stages, self._nodes = [], []
        return out

    def finish(self, failed: Iterable[int], ticket: int | None = None) -> None:
        """The stages `take` handed out under `ticket` (None: the oldest batch in
        flight) ran; those at the positions given failed."""
        if ticket is None:
            ticket = next(iter(self._inflight), None)
        nodes = self._inflight.pop(ticket, None)
        if nodes is None:
            return
        bad = set(failed)
        self.num_failed += len(bad)
        for i, node in enumerate(nodes):
            self.staging.discard(node)
            if i in bad:
                self.host.drop(node)
                self.disk.drop(node)  # not trusted again (prunes the node if nothing else holds it)
            else:
                self.host.confirm(node)
                self.num_staged += 1

    def check_integrity(self) -> None:
        queued = self._nodes
        inflight = [n for nodes in self._inflight.values() for n in nodes]
        assert len(queued) + len(inflight) == len(self.staging) and self.staging == set(queued) | set(inflight), \
            "a stage neither queued nor in flight, or two stages of one node"
        for n in self.staging:
            assert n in self.host.pending and n.disk_slot is not None and n not in self.disk.pending, \
                "a stage without its pending host slot or its disk copy"
