"""The Ray side of the tool statistics the replicas share
(policy/shared_tool_stats.py): the hub lives in a small named actor the
cluster's driver starts (so a replica that dies takes nothing with it), and
each replica runs one loop that, every interval of its engine's clock, takes
its new samples on the engine thread, exchanges them with the hub, and takes
up the merged windows on the engine thread. The log says when a merge brought
something new; a hub that cannot be reached is logged once and tried again
next interval (the replica goes on learning on its own meanwhile)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from agentserve.policy.shared_tool_stats import ToolStatsHub, ToolStatsShare

log = logging.getLogger("agentserve.router")

HUB_NAME = "agentserve-tool-stats"
NAMESPACE = "agentserve"


class ToolStatsHubActor:
    def __init__(self) -> None:
        self.hub = ToolStatsHub()

    def exchange(self, replica: str, sent: dict[str, Any]) -> dict[str, Any]:
        return self.hub.exchange(replica, sent)

    def counts(self) -> dict[str, Any]:
        return {"merges": self.hub.merges, "samples": self.hub.samples, "tools": len(self.hub.stats.tools())}


def start_hub() -> Any:
    """The hub actor, started by the cluster's driver (it lives as long as the driver)."""
    return ray.remote(num_cpus=0)(ToolStatsHubActor).options(
        name=HUB_NAME, namespace=NAMESPACE, get_if_exists=True).remote()


def find_hub() -> Any | None:
    try:
        return ray.get_actor(HUB_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


async def share_loop(replica_id: str, engine: Any, stats: Any, clock: Any, interval: float) -> None:
    """Exchange `stats` (the policy's ToolDurationStats, owned by the engine thread of the
    server's AsyncEngine `engine`) with the hub every `interval` seconds of `clock`, until
    cancelled."""
    share = await engine.call(lambda: ToolStatsShare(stats, interval))
    warned = False
    while True:
        now = clock.now()
        if share.due(now):
            hub = find_hub()
            try:
                if hub is None:
                    raise RuntimeError(f"no actor {HUB_NAME!r} in namespace {NAMESPACE!r}")
                sent, before = await engine.call(lambda: (share.take(now), _samples(stats)))
                merged = await hub.exchange.remote(replica_id, sent)
                tools, after = await engine.call(lambda: (share.apply(merged), len(stats.tools()),
                                                          _samples(stats))[1:])
                warned = False
                if sent["samples"] or after != before:
                    log.info("tool statistics merged with the cluster's (exchange %d): sent %d sample(s); now %d "
                             "tool(s), %d sample(s)", share.exchanges, len(sent["samples"]),
                             tools, after)
            except (ray.exceptions.RayError, RuntimeError, ValueError) as e:
                if not warned:
                    log.warning("tool statistics: the exchange with the cluster failed (%s); learning alone "
                                "until it works again", e)
                    warned = True
        await asyncio.sleep(max(0.05, share.interval - (clock.now() - now)))


def _samples(stats: Any) -> int:
    return sum(stats.count(t) for t in stats.tools())
