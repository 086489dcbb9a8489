"""The Ray plumbing of the tool statistics the replicas share
(router/shared_tools.py): a hub actor on a local Ray and two replicas' loops,
each on an engine stand-in that runs its calls as the engine thread would.
Skipped without Ray."""

from __future__ import annotations

import asyncio
import logging

import pytest

pytest.importorskip("ray")

from agentserve.clock import WallClock  # noqa: E402
from agentserve.policy.tool_stats import ToolDurationStats  # noqa: E402


class Engine:
    """AsyncEngine.call's shape: `fn` run where the statistics live."""

    def __init__(self) -> None:
        self.calls = 0

    async def call(self, fn):
        self.calls += 1
        return fn()


@pytest.fixture(scope="module")
def ray_local():
    import ray

    from cluster_fixtures import local_ray
    local_ray()
    yield ray
    ray.shutdown()


def test_two_replicas_share_their_samples_through_the_hub(ray_local, caplog):
    from agentserve.router.shared_tools import find_hub, share_loop, start_hub

    assert find_hub() is None
    hub = start_hub()
    assert find_hub() is not None
    a, b = ToolDurationStats(), ToolDurationStats()

    async def scenario():
        clock = WallClock()
        loops = [asyncio.create_task(share_loop(name, Engine(), stats, clock, 0.1))
                 for name, stats in (("r1", a), ("r2", b))]
        await asyncio.sleep(0.3)
        a.record("search", 1.0)  # (the stand-in engine thread is this one)
        b.record("search", 3.0)
        b.record("edit", 2.0)
        for _ in range(100):
            await asyncio.sleep(0.1)
            if a.count("search") == 2 and b.count("search") == 2 and a.count("edit") == 1:
                break
        for t in loops:
            t.cancel()
        await asyncio.gather(*loops, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger="agentserve.router"):
        asyncio.run(scenario())
    assert sorted(a.samples("search")) == sorted(b.samples("search")) == [1.0, 3.0]
    assert a.samples("edit") == (2.0,)
    counts = ray_local.get(hub.counts.remote())
    assert counts["samples"] == 3 and counts["tools"] == 2
    assert "tool statistics merged with the cluster's" in caplog.text


def test_a_missing_hub_is_logged_once_and_the_replica_learns_alone(ray_local, caplog, monkeypatch):
    from agentserve.router import shared_tools

    stats = ToolDurationStats()

    async def scenario():
        task = asyncio.create_task(shared_tools.share_loop("r1", Engine(), stats, WallClock(), 0.05))
        await asyncio.sleep(0.4)
        stats.record("search", 1.0)
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    monkeypatch.setattr(shared_tools, "HUB_NAME", "agentserve-no-such-hub")
    with caplog.at_level(logging.WARNING, logger="agentserve.router"):
        asyncio.run(scenario())
    assert caplog.text.count("the exchange with the cluster failed") == 1
    assert stats.samples("search") == (1.0,)
