"""The block-accounting check the engine thread runs each time its work runs out.

A walk over blocks, pins and the prefix index (`Scheduler.check_integrity`)
once per idle period, not per step. A failure is a bug: it is logged with its
traceback and the KV state, and counted (`EngineSnapshot.kv_integrity_failures`,
the metric `agentserve:kv_integrity_failures`); the server goes on serving."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("agentserve.server")


class IdleIntegrity:
    __slots__ = ("checks", "failures")

    def __init__(self) -> None:
        self.checks = 0  # block-accounting checks run when the engine went idle
        self.failures = 0  # ... and those that failed

    def check(self, scheduler: Any) -> None:
        self.checks += 1
        try:
            scheduler.check_integrity()
        except Exception as e:
            self.failures += 1
            kv = scheduler.kv
            log.exception("KV BLOCK ACCOUNTING IS BROKEN (integrity check %d failed on an idle engine, %d "
                          "failure(s) so far): %s: %s; blocks %d, free %d, pinned %d in %d pins, requests "
                          "running %d, waiting %d. Serving goes on; please report this with the log.",
                          self.checks, self.failures, type(e).__name__, e, kv.num_blocks, kv.num_free_blocks,
                          kv.num_pinned_blocks, len(kv.pins), scheduler.num_running, scheduler.num_waiting)
