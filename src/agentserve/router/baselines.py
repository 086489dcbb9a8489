"""The routers program routing is measured against, with `ProgramRouter`'s
interface (`rank`, `routed`, `replica_gone`, `counters`):

- `PowerOfTwoRouter`: Ray Serve's default, power of two choices: two replicas
  drawn at random (a seeded RNG, so a simulation repeats), the one with the
  shorter queue first.
- `PrefixAffinityRouter`: the idea of Ray Serve LLM's PrefixCacheAffinityRouter:
  while the replicas' queues are balanced (longest minus shortest within
  `imbalance`), the replica where the longest chain of the prompt's prefix keys
  went; otherwise, or without a match, the shortest queue. It ignores program ids.
- `RoundRobinRouter`: the healthy replicas in turn, by name."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

from agentserve.router.memory import PrefixMemory
from agentserve.router.program_router import by_name
from agentserve.router.replica_load import ReplicaLoad
from agentserve.router.route_key import RouteKey


class _Counting:
    """Counters by reason, and a router that remembers nothing per replica."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()

    def routed(self, key: RouteKey, replica: str) -> None:
        self._counts["routed"] += 1

    def replica_gone(self, replica: str) -> None:
        pass

    def counters(self) -> dict[str, int]:
        return dict(self._counts)


def _by_queue(loads: Sequence[ReplicaLoad]) -> list[ReplicaLoad]:
    return sorted(loads, key=lambda l: (l.queue, l.replica))


class PowerOfTwoRouter(_Counting):
    name = "pow2"

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self._rng = random.Random(seed)

    def rank(self, key: RouteKey, loads: Sequence[ReplicaLoad]) -> list[list[str]]:
        live = sorted(by_name(loads).values(), key=lambda l: l.replica)  # sorted: the draw repeats
        if len(live) <= 1:
            return [[l.replica] for l in live]
        a, b = self._rng.sample(live, 2)
        first, second = (a, b) if a.queue <= b.queue else (b, a)
        rest = [l for l in _by_queue(live) if l is not first and l is not second]
        return [[first.replica], [second.replica]] + [[l.replica] for l in rest]


class PrefixAffinityRouter(_Counting):
    name = "prefix"

    def __init__(self, imbalance: int = 10, max_prefix_keys: int = 400_000) -> None:
        super().__init__()
        self.imbalance = imbalance  # queue lengths (waiting + running) within this count are balanced
        self.prefixes = PrefixMemory(max_prefix_keys)

    def rank(self, key: RouteKey, loads: Sequence[ReplicaLoad]) -> list[list[str]]:
        live = by_name(loads)
        if not live:
            return []
        order = _by_queue(live.values())
        top = order[0].replica
        if order[-1].queue - order[0].queue <= self.imbalance:
            found, _ = self.prefixes.longest(key.prefix_keys, live.__contains__)
            if found is not None:
                top = found
                self._counts["prefix_matches"] += 1
        else:
            self._counts["imbalanced"] += 1
        return [[top]] + [[l.replica] for l in order if l.replica != top]

    def routed(self, key: RouteKey, replica: str) -> None:
        super().routed(key, replica)
        self.prefixes.remember(key.prefix_keys, replica)

    def replica_gone(self, replica: str) -> None:
        self.prefixes.drop_replica(replica)


class RoundRobinRouter(_Counting):
    name = "round-robin"

    def __init__(self) -> None:
        super().__init__()
        self._next = 0

    def rank(self, key: RouteKey, loads: Sequence[ReplicaLoad]) -> list[list[str]]:
        live = sorted(by_name(loads))
        if not live:
            return []
        k = self._next % len(live)
        self._next += 1
        return [[r] for r in live[k:] + live[:k]]
