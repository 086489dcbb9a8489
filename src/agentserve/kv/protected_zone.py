"""The protected zone: a share of the device KV kept for multi-turn programs
between their turns (kv-lifecycle-design.txt, approach A).

One-shot traffic (requests without a program id, whose KV nobody asks for
again) evicts multi-turn programs' KV between turns under plain LRU, because
a program's history was freed before the newcomer's prompt. The zone holds
the free cached blocks of programs that are alive and between turns, up to
`capacity` blocks, and the pool evicts from it only when nothing else free is
left: newer one-shot prompts go first, whatever their age.

It is a soft reservation, and that is deliberate. The paper's sketch disables
eviction in the zone outright; then a burst of one-shot requests would wait
for memory that sits idle, while here they take it only when the rest of the
cache is in use, which is the moment the alternative is queueing them. The
zone admits blocks while it has room and never replaces a protected block
with a newer one: the program that went to its tool first is, with tools of
similar length, the first to come back.

With TTL pins (the policies' retention) the zone is the second line: a pin
holds a program's blocks outright until its TTL; when the pin expires or is
reclaimed and the program has not ended, its blocks land here instead of in
plain LRU. A program that ends, or that its client releases, leaves the zone
(its blocks go to the eviction strategy as any free cached block)."""

from __future__ import annotations

from agentserve.kv.block import Block
from agentserve.kv.eviction import LinkedList


class ProtectedZone:
    def __init__(self, capacity: int = 0) -> None:
        if capacity < 0:
            raise ValueError(f"the protected zone's capacity must be >= 0 blocks, got {capacity}")
        self.capacity = capacity
        self._list = LinkedList()  # oldest protected first: the first evicted when the zone must give
        self._owner: dict[Block, str] = {}
        self._by_program: dict[str, set[Block]] = {}

    def __len__(self) -> int:
        return self._list.size

    def __contains__(self, block: Block) -> bool:
        return block.strategy_data is self._list

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def admit(self, block: Block, program_id: str) -> bool:
        """Protect free cached `block` for `program_id` if the zone has room."""
        if self._list.size >= self.capacity:
            return False
        self._list.append(block)
        self._owner[block] = program_id
        self._by_program.setdefault(program_id, set()).add(block)
        return True

    def remove(self, block: Block) -> None:
        """`block` leaves the zone (revived by a hit, demoted, or evicted)."""
        self._list.unlink(block)
        pid = self._owner.pop(block)
        blocks = self._by_program[pid]
        blocks.discard(block)
        if not blocks:
            del self._by_program[pid]

    def pop(self) -> Block:
        """The oldest protected block, out of the zone. IndexError when empty."""
        b = self._list.head
        if b is None:
            raise IndexError("the protected zone is empty")
        self.remove(b)
        return b

    def release_program(self, program_id: str) -> list[Block]:
        """Everything `program_id` has in the zone, out of it, oldest first."""
        blocks = self._by_program.get(program_id)
        if not blocks:
            return []
        out = [b for b in self._list if b in blocks]
        for b in out:
            self.remove(b)
        return out

    def programs(self) -> list[str]:
        return list(self._by_program)

    def check_integrity(self) -> None:
        members = list(self._list)
        assert len(members) == self._list.size <= self.capacity, "protected zone over its capacity or miscounted"
        assert set(members) == set(self._owner), "protected zone's owners and members disagree"
        assert sum(map(len, self._by_program.values())) == len(members)
        for pid, blocks in self._by_program.items():
            assert blocks and all(self._owner[b] == pid for b in blocks), f"zone's blocks of {pid} disagree"
        for b in members:
            assert b.ref_cnt == 0 and b.node is not None, f"{b} in the protected zone but not free and cached"
