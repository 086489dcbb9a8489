"""`agentserve sim --replicas N --router NAME`: the simulated cluster. N
engines of the simulator (sim/driver.py, one clock each, side by side in
simulated time), every turn routed at its arrival by a router of this package
fed with every replica's `replica_load`; the result rows and their table.

A simulated turn has token ids, not text, so its prefix keys are those of its
token ids (route_key.token_prefix_keys); its program id is the workload's."""

from __future__ import annotations

from agentserve.router.registry import make_router
from agentserve.router.replica_load import replica_load
from agentserve.router.route_key import RouteKey, token_prefix_keys
from agentserve.sim.driver import Arrival, SimConfig, SimReplica, SimResult, simulate
from agentserve.sim.report import result_row
from agentserve.text_table import aligned
from agentserve.workload.trace import Program


class SimRouting:
    """The `route` of `sim.driver.simulate`: rank the replicas, take the first, remember it."""

    def __init__(self, router) -> None:
        self.router = router

    def __call__(self, arrival: Arrival, replicas: list[SimReplica]) -> int:
        # The router does not use pinned_blocks, and counting them walks every pin.
        loads = [replica_load(r, r.name, count_pinned=False) for r in replicas]
        key = RouteKey(arrival.program.program_id, token_prefix_keys(arrival.prompt),
                       len(arrival.prompt) + arrival.max_tokens, arrival.is_last_turn)
        choice = self.router.rank(key, loads)[0][0]
        self.router.routed(key, choice)
        return next(k for k, r in enumerate(replicas) if r.name == choice)


def simulate_cluster(programs: list[Program], cfg: SimConfig, replicas: int, router: str) -> SimResult:
    """`programs` on `replicas` engines behind the router named `router` (seeded by cfg.seed)."""
    r = make_router(router, seed=cfg.seed)
    result = simulate(programs, cfg, replicas, SimRouting(r))
    result.router = {"name": router, **r.counters()}
    return result


def cluster_row(workload: str, profile: str, rate: float, replicas: int, r: SimResult) -> dict:
    """`sim.report.result_row` with the cluster's figures: `rate` per replica and
    `total_rate`, the router and its counters, and the load spread: the busiest
    replica's model-busy seconds over the mean replica's (1.0: even)."""
    row = result_row(workload, profile, rate, r)
    busy = [x["busy_s"] for x in r.replicas] or [1.0]
    mean_busy = sum(busy) / len(busy)
    row.update(replicas=replicas, total_rate=rate * replicas, router=r.router.get("name", "-"),
               router_counters={k: v for k, v in r.router.items() if k != "name"},
               per_replica=r.replicas, load_spread=max(busy) / mean_busy if mean_busy > 0 else 1.0)
    return row


def format_cluster_table(rows: list[dict]) -> str:
    head = ["policy", "replicas", "router", "rate/replica", "done", "mean JCT", "p99 TTFT", "hit %",
            "load spread", "affinity", "escapes", "prefix", "placed"]
    lines = [head]
    for r in rows:
        c = r["router_counters"]
        lines.append([r["policy"], str(r["replicas"]), r["router"], f"{r['rate']:g}",
                      f"{r['completed']}/{r['programs']}", f"{r['mean_jct']:.1f}", f"{r['p99_ttft']:.2f}",
                      f"{100 * r['hit_ratio']:.1f}", f"{r['load_spread']:.2f}"]
                     + [str(c.get(k, "-")) for k in ("affinity", "escapes", "prefix_matches", "placements")])
    return aligned(lines, left=3)
