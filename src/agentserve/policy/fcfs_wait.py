"""What request-level FCFS would make requests wait here, measured while
another order runs.

An order that keeps the server as busy admits requests at the same pace as
FCFS, only different ones: so the k-th admission happens about when FCFS
would have admitted the k-th arrival, and the time from the k-th arrival to
the k-th admission is the wait FCFS would have given it. Those waits, over a
sliding window of requests, are the yardstick a policy that reorders can hold
its own waits to (agentserve's wait bound). In the simulator their p99 tracked
vllm-fcfs's own p99 TTFT with other orders running (docs/policies.md has the
comparison). A request that leaves the queue without being admitted
(aborted) leaves FCFS's queue too: it moves the count on without a sample."""

from __future__ import annotations

import bisect
from collections import deque


class FcfsWait:
    def __init__(self, window: int = 5000, warmup: int = 50) -> None:
        if window < 1 or warmup < 1:
            raise ValueError(f"window and warmup must be at least 1, got {window!r} and {warmup!r}")
        self.window = window
        self.warmup = warmup  # samples before a quantile is given
        self._arrivals: deque[float] = deque()  # arrival times FCFS has not admitted yet, in order
        self._samples: deque[float] = deque()  # the window, oldest first
        self._sorted: list[float] = []  # the same, sorted

    def __len__(self) -> int:
        return len(self._samples)

    def arrive(self, t: float) -> None:
        self._arrivals.append(t)

    def admit(self, now: float) -> None:
        """A request was admitted (for the first time): FCFS would have admitted
        its oldest arrival now."""
        if not self._arrivals:  # an admission without an arrival seen (a policy swapped in): nothing to pair
            return
        wait = max(0.0, now - self._arrivals.popleft())
        self._samples.append(wait)
        bisect.insort(self._sorted, wait)
        if len(self._samples) > self.window:
            old = self._samples.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def withdraw(self) -> None:
        """A request left the queue without being admitted."""
        if self._arrivals:
            self._arrivals.popleft()

    def quantile(self, q: float) -> float | None:
        """The q-quantile of the window's waits (None: fewer than `warmup` yet)."""
        n = len(self._sorted)
        if n < self.warmup:
            return None
        return self._sorted[min(n - 1, int(q * n))]
