"""Prefetch on the predicted return: a program whose KV went below the device
(host memory, disk) while its tool runs gets it reloaded shortly before its
next turn is likely to arrive, at the time the policy chose when the turn
ended (`Policy.prefetch_plan`, policy/prefetch.py), so the reload is off that
turn's critical path. A plan has up to two parts, each issued once:

* the *stage* (KV expected on disk, a host tier above it): from its time on,
  the chain's blocks whose KV is only on disk are read into host slots
  (kv/stage_copies.py). It takes no device KV, so no KV pressure cancels it;
  it waits only for a host slot no copy under way holds (none to be had:
  cancelled). Landed, the copies are fresh host copies like any other, so the
  turn reloads over the fast host link; once no turn is predicted any more
  (the program ended or was released, or the longest recorded return passed)
  they go to the cold end of the host tier, the first evicted.
* the *load* into the device: from its time on, each step (after admission,
  so a waiting turn takes the free KV first) the chain's blocks that have a
  tier copy and no device block are reloaded (kv/prefetch_loads.py) in one go
  (under the hybrid cache, as far as a hit would have its window, with the
  window parts that are not on the device).
  It is cancelled, and never issued again for that turn, when the reload does
  not fit in the free blocks that the running requests' headroom and the first
  waiting request leave, or a request was held back for KV this step: a
  prefetch never takes KV a turn waits for, and never preempts. Landed, its
  blocks are free cached blocks at the cold end of eviction, the first to go
  when KV runs short, until the turn comes and takes them.

Either part waits while the program's pin still holds its KV (rechecked at
the pin's expiry) and while nothing of the chain has gone where it would
reload from (rechecked every `RECHECK_S`); a load due while the plan's stage is
in flight waits for it.

Outcomes, counted in the scheduler's stats for each part (`prefetch_*` the
load's, `prefetch_stage_*` the stage's): `used` (the turn came after it landed
and found every block still there: on the device; for a stage, in the host
tier or on the device), `late` (the turn came while it was in flight: it waits
for it instead of recomputing), `wasted` (blocks, or window parts it brought
back, were evicted before the turn came, or the program ended or was released
first; `*_wasted_blocks` counts the blocks), `cancelled` (not issued). A plan is dropped without a copy when
the turn comes first, the program ends, the client releases it, or the
longest return the tool's durations recorded has passed."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from agentserve.engine.scheduler_config import SchedulerStats
from agentserve.kv.block import Block
from agentserve.kv.manager import KVCacheManager
from agentserve.kv.prefetch_loads import chain_reload, landed, load_chain, promote, stage_blocks
from agentserve.kv.prefix_index import ChainHint, Node

RECHECK_S = 0.5  # a due part whose chain has nothing to copy yet looks again this much later
STAGE_WAIT_S = 0.01  # a load due while its stage is in flight looks again this much later


@dataclass
class _Plan:
    program_id: str
    at: float | None  # the load's time (None: no load)
    until: float
    tokens: Sequence[int]
    hint: ChainHint | None
    salt: Hashable
    stage_at: float | None = None  # the stage's time (None: no stage)
    loads: list[tuple[Node, Block]] = field(default_factory=list)  # issued: each reloaded node and its block
    parts: set[Block] = field(default_factory=set)  # of those blocks, the ones whose window part it reloaded
    settled: bool = False  # its reloads landed and its blocks went to the cold end
    late: bool = False  # its turn came while the reloads were in flight (counted): it waits for them
    staged: list[Node] = field(default_factory=list)  # the stage issued: its nodes
    stage_late: bool = False  # its turn came while the stage was in flight (counted)
    closed: bool = False  # its turn came: no part is issued any more


class Prefetcher:
    def __init__(self, kv: KVCacheManager, stats: SchedulerStats) -> None:
        self.kv = kv
        self.stats = stats
        self._plans: dict[str, _Plan] = {}
        self._flying: dict[str, _Plan] = {}  # loads issued, not landed yet
        self._staging: dict[str, _Plan] = {}  # stages issued, not landed yet
        self._due: list[tuple[float, int, _Plan, bool]] = []  # (at, n, plan, is the stage) of parts not issued
        self._n = itertools.count()

    def __len__(self) -> int:
        """Plans, and copies in flight (a dropped plan's too: it is settled when it lands)."""
        return len(self._plans) + len(self._flying) + len(self._staging)

    def plan(self, program_id: str, at: float | None, until: float, tokens: Sequence[int], hint: ChainHint | None,
             salt: Hashable, stage_at: float | None = None) -> None:
        """Reload the program's chain (`tokens` under `salt`, indexed along `hint`)
        into the device from `at` on, and stage its blocks only on disk into the
        host tier from `stage_at` on (None: not that part); neither after `until`."""
        self.drop(program_id)
        p = self._plans[program_id] = _Plan(program_id, at, until, tokens, hint, salt, stage_at)
        for t, stage in ((stage_at, True), (at, False)):
            if t is not None:
                heapq.heappush(self._due, (t, next(self._n), p, stage))

    def _pending(self, p: _Plan, stage: bool) -> bool:
        return self._plans.get(p.program_id) is p and not p.closed and not (p.staged if stage else p.loads)

    def next_due(self) -> float | None:
        """When the earliest part not issued yet is due (None: none waits)."""
        h = self._due
        while h and not self._pending(h[0][2], h[0][3]):
            heapq.heappop(h)
        return h[0][0] if h else None

    def in_flight(self, program_id: str) -> bool:
        """The program's prefetch is issued and has not landed: its turn waits for it."""
        p = self._plans.get(program_id)
        if p is None:
            return False
        return (bool(p.loads) and not p.settled and not landed(self.kv, p.loads)) or self._stage_flying(p)

    def _stage_flying(self, p: _Plan) -> bool:
        staging = self.kv.stages.staging
        return bool(p.staged) and any(n in staging for n in p.staged)

    # --- each step ---

    def settle(self, now: float) -> None:
        """Issued prefetches whose copies all landed: a load's blocks to the cold
        end (the first evicted when KV runs short) until the turn comes; a late
        part's turn already waits, so it is done and its copies stay where the
        turn finds them."""
        for pid, p in list(self._flying.items()):
            if not landed(self.kv, p.loads):
                continue
            del self._flying[pid]
            p.settled = True
            if not p.late:  # deepest first, as the pool evicts a chain (a block whose tier copy is gone stays)
                self.kv.pool.demote(b for n, b in reversed(p.loads) if _holds(n, b) and _has_copy(n))
            self._close_late(p)
        for pid, p in list(self._staging.items()):
            if not self._stage_flying(p):
                del self._staging[pid]
                self._close_late(p)

    def _close_late(self, p: _Plan) -> None:
        """A plan whose turn came while a part was in flight ends once none is."""
        if (p.late or p.stage_late) and p.program_id not in self._flying and p.program_id not in self._staging:
            if self._plans.get(p.program_id) is p:
                del self._plans[p.program_id]

    def issue(self, now: float, room: int, blocked: bool) -> None:
        """Issue the parts due by `now`. `room`: free blocks the running requests'
        headroom and the first waiting request leave; `blocked`: a request was
        held back for KV this step."""
        h = self._due
        retry = []
        while h and h[0][0] <= now:
            _, _, p, stage = heapq.heappop(h)
            if not self._pending(p, stage):
                continue
            if now > p.until:  # later than any recorded return: no longer predicted
                self._lapse(p)
                continue
            pin = self.kv.pins.get(p.program_id)
            if pin is not None:  # its KV is on the device while the pin holds
                retry.append((max(pin.expiry, now + 1e-6), p, stage))
                continue
            if stage:
                self._issue_stage(p, now, retry)
                continue
            if self._stage_flying(p):
                retry.append((now + STAGE_WAIT_S, p, stage))
                continue
            r = chain_reload(self.kv, self.kv.index.walk(p.tokens, salt=p.salt, hint=p.hint))
            if r is None:
                retry.append((now + RECHECK_S, p, stage))
                continue
            loads = None if blocked or r.need > room else load_chain(self.kv, r, now)
            if loads is None:
                self.stats.prefetch_cancelled += 1
                p.at = None
                if p.stage_at is None:  # (a stage planned or issued keeps the plan: its turn counts it)
                    del self._plans[p.program_id]
                continue
            p.loads = loads
            p.parts = {n.block for n in r.parts}
            self._flying[p.program_id] = p
            room -= r.need
            self.stats.prefetch_issued += 1
            self.stats.prefetch_blocks += r.taken
        for at, p, stage in retry:
            heapq.heappush(h, (at, next(self._n), p, stage))

    def _issue_stage(self, p: _Plan, now: float, retry: list) -> None:
        nodes = stage_blocks(self.kv, self.kv.index.walk(p.tokens, salt=p.salt, hint=p.hint))
        if not nodes:
            retry.append((now + RECHECK_S, p, True))
            return
        staged = self.kv.stages.stage(nodes)
        if not staged:
            self.stats.prefetch_stage_cancelled += 1
            p.stage_at = None
            if p.at is None:
                del self._plans[p.program_id]
            return
        p.staged = staged
        self._staging[p.program_id] = p
        self.stats.prefetch_staged += 1
        self.stats.prefetch_staged_blocks += len(staged)

    def _lapse(self, p: _Plan) -> None:
        """No turn is predicted for the plan any more: its staged copies go to the
        cold end of the host tier, counted wasted."""
        del self._plans[p.program_id]
        self._stage_wasted(p, dead=False)

    # --- the program's next turn, its end ---

    def on_turn(self, program_id: str, now: float) -> str | None:
        """The program's next turn arrived: the outcome of its prefetch ("used",
        "late", "wasted"; the load's where one was issued, else the stage's; None:
        none was issued, the plan is dropped). A late one is kept until its copies
        land (the turn waits for them)."""
        p = self._plans.get(program_id)
        if p is None:
            return None
        p.closed = True
        outcome = None
        if p.staged:
            outcome = self._stage_outcome(p)
        if p.loads:
            outcome = self._load_outcome(p, now)
        if not (p.late and program_id in self._flying) and not (p.stage_late and program_id in self._staging):
            del self._plans[program_id]
        return outcome

    def _stage_outcome(self, p: _Plan) -> str:
        if self._stage_flying(p):
            self.stats.prefetch_stage_late += 1
            p.stage_late = True
            return "late"
        host = self.kv.host
        lost = sum(1 for n in p.staged if n.block is None and not host.readable(n))
        p.staged = []  # counted
        if lost:
            self.stats.prefetch_stage_wasted += 1
            self.stats.prefetch_stage_wasted_blocks += lost
            return "wasted"
        self.stats.prefetch_stage_used += 1
        return "used"

    def _load_outcome(self, p: _Plan, now: float) -> str:
        if not p.settled and not landed(self.kv, p.loads):
            self.stats.prefetch_late += 1
            p.late = True  # counted; the plan only makes the turn wait now (settle ends it)
            return "late"
        held = [b for n, b in p.loads if _holds(n, b) and (b.wpart is not None or b not in p.parts)]
        promote(self.kv, held, now)  # out of the cold end: the turn takes them
        lost = len(p.loads) - len(held)
        p.loads = []  # counted
        if lost:
            self.stats.prefetch_wasted += 1
            self.stats.prefetch_wasted_blocks += lost
            return "wasted"
        self.stats.prefetch_used += 1
        return "used"

    def drop(self, program_id: str) -> None:
        """The program ended, or the client released it: no copy from now on; an
        issued part whose turn never came is wasted (staged copies that landed
        go to the cold end of the host tier)."""
        p = self._plans.pop(program_id, None)  # (copies in flight stay in _flying, _staging until they land)
        if p is None:
            return
        if p.loads and not p.late:
            self.stats.prefetch_wasted += 1
            self.stats.prefetch_wasted_blocks += len(p.loads)
        if not p.stage_late:
            self._stage_wasted(p, dead=True)

    def _stage_wasted(self, p: _Plan, dead: bool) -> None:
        if not p.staged:
            return
        self.stats.prefetch_stage_wasted += 1
        self.stats.prefetch_stage_wasted_blocks += len(p.staged)
        host = self.kv.host
        for n in p.staged:
            if host.readable(n) and n.block is None:
                host.demote(n, dead and n.disk_slot is not None)
        p.staged = []


def _holds(node: Node, block: Block) -> bool:
    return node.block is block and block.node is node


def _has_copy(node: Node) -> bool:
    return node.host_slot is not None or node.disk_slot is not None
