"""Host copies of the hybrid cache's window parts (kv/window_parts.py).

A prefix hit through blocks reloaded from the host tier needs, like one on the
device, the window parts of the blocks its first new token reads. So when an
indexed block with a part is copied to the host tier (evicted, or its turn
swapped out), its part's `pages` are copied too, into as many slots the host
tier lends beside the block's own (`SlotTier.take_slots`): the node's *part
copy*. A part copy lives and dies with its node's host slot (the tier tells
`forget` when the node loses it), is not read until all its pages' writes are
confirmed (a failed one drops the part copy, not the block's), and is not made
for a block whose part is already gone. Under pressure the device evicts an
unheld part before its block (kv/window_parts.py): the part is then copied
with its block's host copy (written back early), so that a hit reloads it,
alone into the block still on the device, or with the block once that is
evicted too.

A match counts a node as having its part where its part copy is readable
(`WindowParts.host_part`). Admitting it takes fresh pages for the parts of
the hit's window it reloads, and queues their reloads beside those of the
blocks (kv/copies.py): the reload holds that part until its copies ran
(`filling`), its request computes only once they landed (the block is
`loading`), no other match takes the block meanwhile, and a failed page fails
its block (detached, its host copy dropped), so the request is cut back and
recomputes rather than read a part that was not written."""

from __future__ import annotations

from collections.abc import Iterable

from agentserve.kv.block import Block
from agentserve.kv.block_table import BlockTable
from agentserve.kv.copies import CopyQueue
from agentserve.kv.host_tier import HostTier
from agentserve.kv.prefix_index import Node
from agentserve.kv.prefix_match import PrefixMatch
from agentserve.kv.window_parts import WindowParts


class PartCopy:
    """A node's part copy: the host slots of its pages, in page order."""

    __slots__ = ("owner", "node", "slots", "pending")

    def __init__(self, owner: WindowTier, node: Node, slots: list[int]) -> None:
        self.owner = owner
        self.node = node
        self.slots = slots
        self.pending = True  # until every page's write is confirmed

    def settle(self, failed: bool) -> None:
        """Its writes ran (kv/copies.py): `failed`, one of them did not."""
        if self.owner.copies_of.get(self.node) is not self:
            return  # the node lost its host slot meanwhile: its slots went back already
        if failed:
            self.owner.forget(self.node)
        else:
            self.pending = False


class WindowTier:
    def __init__(self, parts: WindowParts, host: HostTier, copies: CopyQueue) -> None:
        self.parts = parts
        self.host = host
        self.copies = copies
        self.copies_of: dict[Node, PartCopy] = {}
        self.filling: set[Block] = set()  # blocks whose part a queued or running reload fills (and holds)
        # those of them on the device meanwhile, and their nodes: the fill holds a reference on each
        # (a prefetch's block is held by no table: it must not be evicted while its part lands)
        self.into_device: dict[Block, Node] = {}
        self.num_stored = 0  # part copies made, ever
        self.num_reloaded = 0  # parts reloaded (with their blocks, or into blocks still on the device), ever
        host.on_forget = self.forget
        copies.on_part_loaded = self._filled
        parts.host_part = self.readable
        parts.on_evict = self._part_evicted

    def readable(self, node: Node) -> bool:
        pc = self.copies_of.get(node)
        return pc is not None and not pc.pending and self.host.readable(node)

    def store(self, node: Node, block: Block, protect: Iterable[Node]) -> None:
        """Copy `block`'s part, if it has one, beside `node`'s host slot (given
        or queued); nothing when the node has a part copy or the tier cannot
        make room without evicting `protect` (the nodes being reloaded)."""
        if block.wpart is None or node.host_slot is None or node in self.copies_of:
            return
        slots = self.host.take_slots(self.parts.pages, {node, *protect})
        if slots is None:
            return
        pc = self.copies_of[node] = PartCopy(self, node, slots)
        self.num_stored += 1
        for page, slot in zip(block.wpart, slots):
            self.copies.write(page.block_id, slot, pc)

    def _part_evicted(self, block: Block) -> None:
        """`block`'s unheld part leaves the device: copy it, with the block, to the host tier."""
        node = block.node
        if node in self.copies_of or node in self.copies.loading:
            return
        if node.host_slot is None:
            slot = self.host.store(node, self.copies.loading)
            if slot is None:
                return
            self.copies.offload(block, slot, node)
        self.store(node, block, self.copies.loading)

    def forget(self, node: Node) -> None:
        """`node` lost its host slot: its part copy's slots go back. A write
        still queued into them lands in free slots, and is ignored when it settles."""
        pc = self.copies_of.pop(node, None)
        if pc is not None:
            self.host.give_back(pc.slots)

    # --- an admission that reloads ---

    def hold(self, st: BlockTable, match: PrefixMatch) -> list[tuple[int, list[Block]]]:
        """Before an admission of `match` into `st` allocates: `st` holds the
        parts of the hit's window on the device (the allocation would evict
        them unheld), and fresh pages are taken for those it reloads. Returns
        (position, pages) of each of those, for `fill`. The caller checked the
        pool has the pages (`WindowParts.admit_need`)."""
        parts, nodes = self.parts, match.nodes
        lo = parts.first_needed(match.num_tokens)
        reload = []
        for i in range(lo, len(nodes)):  # hold the parts there first: taking pages may evict unheld ones
            b = nodes[i].block
            if b is not None and b.wpart is not None:
                parts.acquire(b)
                st.window[i] = b
            elif self.readable(nodes[i]):  # not on the device, or on it without its part: from its copy
                reload.append(i)
                if b is not None:  # its copy is read by no block reload that keeps it: keep it until read,
                    self.into_device[b] = nodes[i]  # and the block, whose reload is not holding it either
                    self.host.reading.add(nodes[i])
                    parts.pool.ref(b)
            else:
                raise RuntimeError(f"the window part of block {i} of a match is gone")
        out = []
        for i in reload:
            pages = parts.pool.allocate(parts.pages)
            if pages is None:
                raise RuntimeError(f"no pages for the window part reloaded into block {i} of a match")
            out.append((i, pages))
        return out

    def fill(self, st: BlockTable, reloads: list[tuple[int, list[Block]]]) -> None:
        """Queue the part reloads `hold` prepared, into the blocks `st` now holds
        at those positions (their own reloads queued, or on the device: then
        `st` waits for the part as for a block's reload); `st` holds the parts."""
        for i, pages in reloads:
            if st.blocks[i] not in st.loads:
                st.loads.append(st.blocks[i])
            b = st.blocks[i]
            node = b.node
            self.parts.adopt(b, pages)
            self.filling.add(b)
            self.num_reloaded += 1
            for page, slot in zip(pages, self.copies_of[node].slots):
                self.copies.load_page(node, b, slot, page)
            self.parts.acquire(b)
            st.window[i] = b

    def _filled(self, block: Block, now: float) -> None:
        """The reloads of `block`'s part ran (a failure detached the block: its part goes unheld)."""
        self.filling.discard(block)
        node = self.into_device.pop(block, None)
        self.parts.release(block, now)
        if node is not None:
            self.host.reading.discard(node)
            self.parts.pool.release([block], now)

    def check_integrity(self) -> None:
        slots = []
        writers = self.copies.writers
        for node, pc in self.copies_of.items():
            assert pc.node is node and node.host_slot is not None, "a part copy outlived its node's host slot"
            assert len(pc.slots) == self.parts.pages
            assert not pc.pending or pc in writers, "a pending part copy neither queued nor in flight"
            slots.extend(pc.slots)
        self.host.check_lent(slots)
        for b in self.filling:
            assert b.wpart is not None and b.wrefs > 0, f"{b}'s part is filled by a reload that does not hold it"
            assert b.node is not None and (b.node in self.copies.loading or self.into_device.get(b) is b.node), \
                f"{b}'s part fills without its block"
        assert set(self.into_device) <= self.filling and set(self.into_device.values()) == self.host.reading
