"""The program-aware router: `ProgramRouter` and its `RouterConfig`.

Policy, for one request and the replicas' loads (only healthy ones are ranked):
- A program's turn goes to its home, the replica that holds its KV: where the
  router last sent it, checked against the replicas' reports (`ReplicaLoad.programs`):
  when the reports show it on other replicas only (another router instance or a
  restart sent it there), the least loaded of those is its home.
- Load escape: the home is left when its load exceeds the least-loaded
  replica's by more than `escape_margin` or `escape_ratio` times that load,
  whichever is larger; the program is then placed anew and its KV re-prefilled
  there (counted as an escape). Moving a program costs a re-prefill of its whole
  context, so only a clear imbalance moves it.
- A request without a program id goes where the longest chain of its prefix
  keys was last routed (prefix affinity), with the same escape.
- Anything else (a new program, an escape, an id-less request with no match) is
  placed by KV load: the replica with the lowest load once the request's
  `size_hint` tokens are counted against its free KV; ties go to the most free
  KV, then in turn around the replicas' names (deterministic, and a run of new
  programs on idle replicas is spread even while their reports lag).

Load of a replica = waiting + running requests + `kv_weight` x the share of
its device KV held by requests and pins: a full KV weighs as `kv_weight` queued
requests, since a new program there must wait for room or evict a pin."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from agentserve.router.memory import LruMap, PrefixMemory
from agentserve.router.replica_load import ReplicaLoad
from agentserve.router.route_key import RouteKey

_PENDING = 4096  # ranked keys whose decision waits for `routed` (concurrent routings in flight)


@dataclass
class RouterConfig:
    # leave a program's home when its load exceeds the least-loaded replica's by more than
    # max(escape_margin, escape_ratio x that load)
    escape_margin: float = 16.0
    escape_ratio: float = 0.5
    kv_weight: float = 8.0  # a full device KV weighs as this many queued requests
    max_programs: int = 100_000  # programs remembered (least recently routed forgotten first)
    max_prefix_keys: int = 400_000  # prefix-chain keys remembered (about 6,000 prompts of 64 keys)

    def __post_init__(self) -> None:
        if self.escape_margin < 0 or self.escape_ratio < 0 or self.kv_weight < 0:
            raise ValueError("escape_margin, escape_ratio and kv_weight must be >= 0")


def load_of(load: ReplicaLoad, kv_weight: float, extra_tokens: int = 0) -> float:
    """A replica's load, with `extra_tokens` more of its KV in use."""
    total = load.total_blocks * load.block_size
    used = 1.0 - (load.free_tokens - extra_tokens) / total if total else 1.0
    return load.queue + kv_weight * used


def by_name(loads: Sequence[ReplicaLoad]) -> dict[str, ReplicaLoad]:
    """The healthy replicas by name."""
    return {l.replica: l for l in loads if l.healthy}


class ProgramRouter:
    name = "program"

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self.homes = LruMap(self.config.max_programs)  # program id -> replica it was last routed to
        self.prefixes = PrefixMemory(self.config.max_prefix_keys)  # prefix key -> replica
        self._pending: OrderedDict[RouteKey, tuple[str, str]] = OrderedDict()  # key -> (top replica, why)
        self._counts: Counter[str] = Counter()
        self._turn = 0  # placements made: where the round of tie-breaks starts

    # --- deciding ---

    def rank(self, key: RouteKey, loads: Sequence[ReplicaLoad]) -> list[list[str]]:
        """Healthy replicas, most preferred first, one a rank: the choice, then the
        rest by placement order (where to go when the choice cannot take it)."""
        live = by_name(loads)
        if not live:
            return []
        w = self.config.kv_weight
        names = sorted(live)
        turn = {n: (i - self._turn) % len(names) for i, n in enumerate(names)}
        order = sorted(live.values(), key=lambda l: (load_of(l, w, key.size_hint), -l.free_blocks, turn[l.replica]))
        least = min(load_of(l, w) for l in live.values())
        top, why = order[0].replica, "placements"
        home = self._home(key, live) if key.program_id is not None else None
        if home is not None:
            top, why = home, "affinity"
        elif key.program_id is None:
            found, _ = self.prefixes.longest(key.prefix_keys, live.__contains__)
            if found is not None:
                top, why = found, "prefix_matches"
        if why != "placements" and self._overloaded(live[top], least):
            top, why = next(l.replica for l in order if l.replica != top), "escapes"  # overloaded: never the least
        self._pending[key] = (top, why)
        if len(self._pending) > _PENDING:
            self._pending.popitem(last=False)
        return [[top]] + [[l.replica] for l in order if l.replica != top]

    def _home(self, key: RouteKey, live: dict[str, ReplicaLoad]) -> str | None:
        pid = key.program_id
        remembered = self.homes.peek(pid)
        holders = [l for l in live.values() if pid in l.programs]
        if remembered in live and (not holders or any(l.replica == remembered for l in holders)):
            return remembered
        if holders:  # the reports know better than this router's memory
            if remembered is not None:
                self._counts["corrected"] += 1
            w = self.config.kv_weight
            return min(holders, key=lambda l: (load_of(l, w), l.replica)).replica
        return None

    def _overloaded(self, load: ReplicaLoad, least: float) -> bool:
        c = self.config
        return load_of(load, c.kv_weight) - least > max(c.escape_margin, c.escape_ratio * least)

    # --- remembering ---

    def routed(self, key: RouteKey, replica: str) -> None:
        """The request went to `replica`: remember it for the program's next turn
        (forgotten when this was its last) and for its prefix keys."""
        top = self._pending.pop(key, None)
        self._counts[top[1] if top is not None and top[0] == replica else "fallbacks"] += 1
        if top is not None and top[1] in ("placements", "escapes"):
            self._turn += 1
        if key.program_id is not None:
            if key.end_program:
                self.homes.pop(key.program_id)
            else:
                self.homes.set(key.program_id, replica)
        self.prefixes.remember(key.prefix_keys, replica)

    def replica_gone(self, replica: str) -> None:
        """Forget a dead replica: its programs are placed anew on their next turn
        (and re-prefilled there), its prefixes match nothing."""
        self._counts["programs_lost"] += self.homes.drop_replica(replica)
        self.prefixes.drop_replica(replica)
        for k in [k for k, (top, _) in self._pending.items() if top == replica]:
            del self._pending[k]

    def counters(self) -> dict[str, int]:
        """Routing decisions by reason (affinity, escapes, prefix_matches, placements,
        fallbacks: sent elsewhere than ranked first), corrections of the memory by the
        replicas' reports, programs lost with a replica, and the memory's sizes."""
        out = {k: 0 for k in ("affinity", "escapes", "prefix_matches", "placements", "fallbacks")}
        out.update(self._counts)
        out["programs_remembered"] = len(self.homes)
        out["prefix_keys_remembered"] = len(self.prefixes)
        return out
