"""Prefetch on the predicted return: a program whose KV went below the device
(host memory, disk) while its tool runs gets it reloaded shortly before its
next turn is likely to arrive, at the time the policy chose when the turn
ended (`Policy.prefetch_plan`, policy/prefetch.py), so the reload is off that
turn's critical path.

A plan is due at its time; from then on, each step (after admission, so a
waiting turn takes the free KV first) the program's last chain is walked and
its blocks that have a tier copy and no device block are reloaded
(kv/prefetch_loads.py) in one go, once. It waits while the program's pin still
holds its KV (rechecked at the pin's expiry) and while nothing of the chain
has gone below yet (rechecked every `RECHECK_S`). It is cancelled, and never
issued again for that turn, when the reload does not fit in the free blocks
that the running requests' headroom and the first waiting request leave, or a
request was held back for KV this step: a prefetch never takes KV a turn
waits for, and never preempts. Landed,
its blocks are free cached blocks at the cold end of eviction, the first to
go when KV runs short, until the turn comes and takes them.

Outcomes, counted in the scheduler's stats: `used` (the turn came after the
reload landed and found every prefetched block still on the device), `late`
(the turn came while the reload was in flight: it waits for it instead of
recomputing), `wasted` (blocks were evicted before the turn came, or the
program ended or was released first; `prefetch_wasted_blocks` counts the
blocks), `cancelled` (not issued under KV pressure). A plan is dropped without
a reload when the turn comes first, the program ends, the client releases it,
or the longest return the tool's durations recorded has passed."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from agentserve.engine.scheduler_config import SchedulerStats
from agentserve.kv.block import Block
from agentserve.kv.manager import KVCacheManager
from agentserve.kv.prefetch_loads import landed, load_chain, promote, tier_blocks
from agentserve.kv.prefix_index import ChainHint, Node

RECHECK_S = 0.5  # a due plan whose chain is all on the device looks again this much later


@dataclass
class _Plan:
    program_id: str
    at: float
    until: float
    tokens: Sequence[int]
    hint: ChainHint | None
    salt: Hashable
    loads: list[tuple[Node, Block]] = field(default_factory=list)  # issued: each reloaded node and its block
    settled: bool = False  # its reloads landed and its blocks went to the cold end
    late: bool = False  # its turn came while the reloads were in flight (counted): it waits for them


class Prefetcher:
    def __init__(self, kv: KVCacheManager, stats: SchedulerStats) -> None:
        self.kv = kv
        self.stats = stats
        self._plans: dict[str, _Plan] = {}
        self._flying: dict[str, _Plan] = {}  # issued, not landed yet
        self._due: list[tuple[float, int, _Plan]] = []  # (at, n, plan) of plans not issued yet
        self._n = itertools.count()

    def __len__(self) -> int:
        """Plans, and reloads in flight (a dropped plan's too: it is settled when it lands)."""
        return len(self._plans) + len(self._flying)

    def plan(self, program_id: str, at: float, until: float, tokens: Sequence[int], hint: ChainHint | None,
             salt: Hashable) -> None:
        """Reload the program's chain (`tokens` under `salt`, indexed along `hint`)
        from `at` on, not after `until`."""
        self.drop(program_id)
        p = self._plans[program_id] = _Plan(program_id, at, until, tokens, hint, salt)
        heapq.heappush(self._due, (at, next(self._n), p))

    def next_due(self) -> float | None:
        """When the earliest plan not issued yet is due (None: none waits)."""
        h = self._due
        while h and self._plans.get(h[0][2].program_id) is not h[0][2]:
            heapq.heappop(h)
        return h[0][0] if h else None

    def in_flight(self, program_id: str) -> bool:
        """The program's prefetch is issued and has not landed: its turn waits for it."""
        p = self._plans.get(program_id)
        return p is not None and bool(p.loads) and not p.settled and not landed(self.kv, p.loads)

    # --- each step ---

    def settle(self, now: float) -> None:
        """Issued prefetches whose reloads all landed: their blocks to the cold end
        (the first evicted when KV runs short) until the turn comes; a late one's
        turn already waits, so it is done and its blocks stay where the turn finds them."""
        for pid, p in list(self._flying.items()):
            if not landed(self.kv, p.loads):
                continue
            del self._flying[pid]
            p.settled = True
            if p.late:
                if self._plans.get(pid) is p:
                    del self._plans[pid]
            else:  # deepest first, as the pool evicts a chain (a block whose tier copy is gone stays)
                self.kv.pool.demote(b for n, b in reversed(p.loads) if _holds(n, b) and _has_copy(n))

    def issue(self, now: float, room: int, blocked: bool) -> None:
        """Issue the plans due by `now`. `room`: free blocks the running requests'
        headroom and the first waiting request leave; `blocked`: a request was
        held back for KV this step."""
        h = self._due
        retry = []
        while h and h[0][0] <= now:
            _, _, p = heapq.heappop(h)
            if self._plans.get(p.program_id) is not p or p.loads:
                continue
            if now > p.until:  # later than any recorded return: no longer predicted
                del self._plans[p.program_id]
                continue
            pin = self.kv.pins.get(p.program_id)
            if pin is not None:  # its KV is on the device while the pin holds
                retry.append((max(pin.expiry, now + 1e-6), p))
                continue
            path = self.kv.index.walk(p.tokens, salt=p.salt, hint=p.hint)
            nodes = tier_blocks(self.kv, path)
            if not nodes:
                retry.append((now + RECHECK_S, p))
                continue
            loads = None if blocked or len(nodes) > room else load_chain(self.kv, nodes, path, now)
            if loads is None:
                self.stats.prefetch_cancelled += 1
                del self._plans[p.program_id]
                continue
            p.loads = loads
            self._flying[p.program_id] = p
            room -= len(nodes)
            self.stats.prefetch_issued += 1
            self.stats.prefetch_blocks += len(nodes)
        for at, p in retry:
            p.at = at
            heapq.heappush(h, (at, next(self._n), p))

    # --- the program's next turn, its end ---

    def on_turn(self, program_id: str, now: float) -> str | None:
        """The program's next turn arrived: the outcome of its prefetch ("used",
        "late", "wasted"; None: none was issued, the plan is dropped). A late one is
        kept until its reloads land (the turn waits for them)."""
        p = self._plans.get(program_id)
        if p is None:
            return None
        if not p.loads:
            del self._plans[program_id]
            return None
        if not p.settled and not landed(self.kv, p.loads):
            self.stats.prefetch_late += 1
            p.late = True  # counted; the plan only makes the turn wait now (settle ends it)
            return "late"
        del self._plans[program_id]
        held = [b for n, b in p.loads if _holds(n, b)]
        promote(self.kv, held, now)  # out of the cold end: the turn takes them
        lost = len(p.loads) - len(held)
        if lost:
            self.stats.prefetch_wasted += 1
            self.stats.prefetch_wasted_blocks += lost
            return "wasted"
        self.stats.prefetch_used += 1
        return "used"

    def drop(self, program_id: str) -> None:
        """The program ended, or the client released it: no reload from now on; an
        issued prefetch whose turn never came is wasted."""
        p = self._plans.pop(program_id, None)  # (one in flight stays in _flying: landed, to the cold end)
        if p is not None and p.loads and not p.late:
            self.stats.prefetch_wasted += 1
            self.stats.prefetch_wasted_blocks += len(p.loads)


def _holds(node: Node, block: Block) -> bool:
    return node.block is block and block.node is node


def _has_copy(node: Node) -> bool:
    return node.host_slot is not None or node.disk_slot is not None
