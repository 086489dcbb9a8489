"""How the engine process uses Python's cyclic garbage collector.

The scheduler's state is a large, long-lived heap: a KV block per block of the
pool (built at start-up), a prefix-index node per cached block, the requests
and their token lists, the pins. CPython's collector walks every tracked object
of a generation when it collects it, and a full (generation-2) collection over
that heap stalls the engine thread for the length of several decode steps at
hundreds of running requests and a thousand pins (`python -m benchmarks sched`
measures it), while finding nothing to free: the
engine's objects are freed by reference counting, not by the collector. Young
collections still run every 700 net allocations, each walking what survived
since the last one.

So the engine, once it has started (model loaded, KV pool built):

1. collects once and freezes what is alive (`gc.freeze()`): the start-up heap
   (the model's Python objects, the block pool, the imported modules) moves to
   the permanent generation, which no collection walks. It is done once a
   process: a frozen object is never collected, so freezing per step or per
   request would leak whatever of it later became cyclic garbage.
2. stops automatic full collections and runs them itself: when the engine runs
   out of work (`on_idle`, at most every `idle_full_interval_s`), and, on an
   engine that is never idle, at least every `busy_full_interval_s` (a bound on
   what cyclic garbage could pile up in the oldest generation: in `bench sched`
   no collection of any generation found any).

Young collections (generations 0 and 1) stay as CPython runs them: they cost
a small fraction of a step, most of it walking the token lists of the turns
admitted since the last one. Larger thresholds made them cost more a step, not
less, in `bench sched`, with pauses several times as long. `young_threshold` is
there to try another on a given machine.

`PYTHON_DEFAULT` leaves CPython's collector as it is (the server's `--gc
python`). The policy is process-wide (the collector is), so the functions here
are what the server's start-up and `python -m benchmarks sched` call; nothing else
in the engine touches the collector."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("agentserve.engine")

NO_AUTO_FULL = 1_000_000  # gen-2 threshold: young collections between full ones; this many means none


@dataclass(frozen=True)
class GCPolicy:
    name: str
    freeze: bool = True  # collect and freeze the start-up heap, once a process
    young_threshold: int | None = None  # gen-0 threshold (None: CPython's, 700)
    manual_full: bool = True  # no automatic full collections: on_idle / maybe_collect run them
    idle_full_interval_s: float = 60.0  # an idle engine's full collections, at most this often
    busy_full_interval_s: float = 600.0  # a busy engine's, at least this often


ENGINE = GCPolicy("engine")
PYTHON_DEFAULT = GCPolicy("python", freeze=False, young_threshold=None, manual_full=False)
POLICIES = {p.name: p for p in (ENGINE, PYTHON_DEFAULT)}


class GCController:
    """The applied policy: its full collections, as the engine loop calls them."""

    def __init__(self, policy: GCPolicy, clock: Callable[[], float]) -> None:
        """`clock`: the engine's (seconds; wall time on a server, simulated time in a benchmark)."""
        self.policy = policy
        self.clock = clock
        self.last_full = clock()
        self.full_collections = 0  # run by this controller
        self.full_collect_s = 0.0  # ... and the time they took

    def _collect(self, why: str) -> None:
        t0 = time.thread_time()  # the collection's CPU time, for the log only
        found = gc.collect()
        took = time.thread_time() - t0
        self.last_full = self.clock()
        self.full_collections += 1
        self.full_collect_s += took
        log.debug("gc: full collection (%s) in %.1f ms, %d unreachable objects", why, took * 1e3, found)

    def on_idle(self) -> bool:
        """The engine ran out of work: a full collection if one is due. True if it ran."""
        if self.policy.manual_full and self.clock() - self.last_full >= self.policy.idle_full_interval_s:
            self._collect("idle")
            return True
        return False

    def maybe_collect(self) -> bool:
        """Between busy steps: a full collection only if none ran for busy_full_interval_s."""
        if self.policy.manual_full and self.clock() - self.last_full >= self.policy.busy_full_interval_s:
            self._collect("busy backstop")
            return True
        return False


_saved_thresholds: tuple[int, int, int] | None = None  # CPython's, before the first apply


def apply_gc_policy(policy: GCPolicy, clock: Callable[[], float]) -> GCController:
    """Apply `policy` to this process once the engine has started (its model
    loaded, its KV pool built); `clock` is the engine's, which times the full
    collections. Freezes only if nothing is frozen yet: a second call (another
    engine in the process) does not freeze again."""
    global _saved_thresholds
    if _saved_thresholds is None:
        _saved_thresholds = gc.get_threshold()
    t0, t1, _ = _saved_thresholds
    frozen_now = 0
    if policy.freeze and gc.get_freeze_count() == 0:
        gc.collect()  # start-up garbage goes first: what is frozen is never collected
        gc.freeze()
        frozen_now = gc.get_freeze_count()
    young = policy.young_threshold if policy.young_threshold is not None else t0
    full = NO_AUTO_FULL if policy.manual_full else _saved_thresholds[2]
    gc.set_threshold(young, t1, full)
    log.info("gc policy %s: %s; thresholds %s%s", policy.name,
             f"froze {frozen_now} start-up objects" if frozen_now else
             f"{gc.get_freeze_count()} objects frozen" if gc.get_freeze_count() else "nothing frozen",
             gc.get_threshold(),
             f"; full collections when idle (at most every {policy.idle_full_interval_s:g} s) and at least "
             f"every {policy.busy_full_interval_s:g} s" if policy.manual_full else "; automatic full collections")
    return GCController(policy, clock)


def restore_gc() -> None:
    """Undo apply_gc_policy: unfreeze and put CPython's thresholds back (a
    benchmark between its runs, tests)."""
    global _saved_thresholds
    if gc.get_freeze_count():
        gc.unfreeze()
    if _saved_thresholds is not None:
        gc.set_threshold(*_saved_thresholds)
        _saved_thresholds = None
