"""What a replica reports to the router: `ReplicaLoad` (KV blocks free and
pinned, queue, running requests, the programs whose KV it holds), its JSON
form, and `replica_load`, which reads it off a live engine.

`replica_load` is called from a thread other than the engine's (Ray Serve's
`routing_stats`, a metrics thread), so it takes no lock and reads only values
that one call of C code produces under the GIL: integers the engine keeps up to
date (`len()` of the running list and of the waiting queue, the pool's free
count, which is `len()` of its free lists) and copies of the pin table's and
the program table's keys, each made in one C-level call (`frozenset(dict)`,
`list(odict.items())`) during which the engine thread cannot run. The values may
come from different steps (a request can finish between two reads), which a
router tolerates: it acts on a load that is stale by a step anyway. A copy that
still meets a concurrent change (a free-threaded interpreter) is retried."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_INT_FIELDS = ("total_blocks", "free_blocks", "pinned_blocks", "waiting", "running", "block_size")
_RETRIES = 8


@dataclass(frozen=True)
class ReplicaLoad:
    replica: str
    total_blocks: int
    free_blocks: int  # blocks no request or pin holds (cached-but-unreferenced blocks count as free)
    pinned_blocks: int  # distinct blocks held by program pins
    waiting: int  # requests queued, not yet admitted
    running: int  # requests admitted (prefilling or decoding)
    # program ids whose KV the replica holds, pinned or cached (scoped ids, as the engine names them)
    programs: frozenset[str] = field(default_factory=frozenset)
    healthy: bool = True
    block_size: int = 16  # tokens per block, to compare free blocks with a request's size in tokens

    @property
    def queue(self) -> int:
        """Requests in the replica: waiting and running."""
        return self.waiting + self.running

    @property
    def kv_used(self) -> float:
        """Share of the device KV held by requests and pins (0..1)."""
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 1.0

    @property
    def free_tokens(self) -> int:
        return self.free_blocks * self.block_size

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: the programs as a sorted list."""
        return {"replica": self.replica, "total_blocks": self.total_blocks, "free_blocks": self.free_blocks,
                "pinned_blocks": self.pinned_blocks, "waiting": self.waiting, "running": self.running,
                "programs": sorted(self.programs), "healthy": self.healthy, "block_size": self.block_size}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReplicaLoad:
        """The inverse of `to_dict`. A missing count is 0, missing programs none, a
        missing `healthy` true (an older replica that reports less still routes);
        `replica` is required, and a value of the wrong type is a ValueError that
        names the field."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a replica load is a JSON object, got {type(d).__name__}")
        name = d.get("replica")
        if not isinstance(name, str) or not name:
            raise ValueError(f"replica load: 'replica' must be a non-empty string, got {name!r}")
        values: dict[str, Any] = {}
        for key in _INT_FIELDS:
            v = d.get(key, 16 if key == "block_size" else 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"replica load of {name}: {key!r} must be an integer >= 0, got {v!r}")
            values[key] = v
        if values["block_size"] < 1:
            raise ValueError(f"replica load of {name}: 'block_size' must be at least 1")
        programs = d.get("programs", ())
        if isinstance(programs, (str, bytes, Mapping)) or not isinstance(programs, (list, tuple, set, frozenset)) \
                or not all(isinstance(p, str) for p in programs):
            raise ValueError(f"replica load of {name}: 'programs' must be a list of strings")
        healthy = d.get("healthy", True)
        if not isinstance(healthy, bool):
            raise ValueError(f"replica load of {name}: 'healthy' must be true or false, got {healthy!r}")
        return cls(name, programs=frozenset(programs), healthy=healthy, **values)


def replica_load(llm_engine: Any, replica: str, *, count_pinned: bool = True) -> ReplicaLoad:
    """The load of an `engine.llm_engine.LLMEngine`, or of anything with a
    `scheduler` (the simulator's `SimReplica`), or of a `Scheduler` itself.

    `programs` are the pinned programs and the live programs of the scheduler's
    program table that have an id (an anonymous request is nobody's program): a
    live program's last turn is in the prefix cache unless pressure evicted it,
    which the router cannot see and the engine re-prefills. Counting distinct
    pinned blocks walks every pin (O(pinned blocks)); `count_pinned=False` skips
    it (pinned_blocks 0) for a caller that asks at every request and does not
    use the figure (the simulator)."""
    sched = getattr(llm_engine, "scheduler", llm_engine)
    kv = sched.kv
    for attempt in range(_RETRIES):
        try:
            pinned_ids = frozenset(kv.pins)
            entries = sched.programs.entries()
            pinned = _distinct_pinned(kv.pins) if count_pinned else 0
            break
        except RuntimeError:  # a table changed during a copy (only without the GIL); read again
            if attempt == _RETRIES - 1:
                raise
    named = frozenset(pid for pid, p in entries if not p.anonymous)
    return ReplicaLoad(replica=replica, total_blocks=kv.num_blocks, free_blocks=kv.num_free_blocks,
                       pinned_blocks=pinned, waiting=sched.num_waiting, running=sched.num_running,
                       programs=named | pinned_ids, block_size=kv.block_size)


def _distinct_pinned(pins: Any) -> int:
    """Distinct blocks the pins hold, from copies (a pin's block list can grow meanwhile)."""
    return len({b.block_id for p in list(pins.values()) for b in tuple(p.blocks)})
