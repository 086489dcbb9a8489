"""The simulated cluster (`agentserve sim --replicas N --router NAME`): one
replica is the plain simulation, program routing keeps the prefix hits that
load-only routing scatters, and the command line's rows."""

from __future__ import annotations

import json

import pytest

from agentserve.cli import main
from agentserve.router.sim_cluster import simulate_cluster
from agentserve.sim.driver import SimConfig, simulate
from agentserve.sim.kv_sizing import replica_blocks
from agentserve.workload.generators import generate_swebench


@pytest.fixture(scope="module")
def workload():
    return generate_swebench(24, 2.0, seed=3)


def test_one_replica_is_the_plain_simulation(workload):
    cfg = SimConfig(policy="agentserve", kv_tokens=60_000)
    plain = simulate(workload, cfg)
    routed = simulate_cluster(workload, cfg, 1, "program")
    assert routed.jct == plain.jct and routed.ttft == plain.ttft and routed.queue_times == plain.queue_times
    assert (routed.steps, routed.hit_ratio, routed.pins, routed.tiers) == (plain.steps, plain.hit_ratio, plain.pins,
                                                                            plain.tiers)
    assert routed.router["placements"] == 24 and routed.router["affinity"] == sum(len(p.calls) - 1 for p in workload)


def test_program_routing_keeps_the_prefix_hits_that_power_of_two_scatters(workload):
    """Two replicas sharing 120k tokens of KV: a program's later turns find their
    KV only where the earlier ones ran."""
    cfg = SimConfig(policy="agentserve", kv_tokens=120_000)
    prog = simulate_cluster(workload, cfg, 2, "program")
    pow2 = simulate_cluster(workload, cfg, 2, "pow2")
    assert prog.completed == pow2.completed == 24
    assert prog.hit_ratio > pow2.hit_ratio + 0.1
    assert prog.router["escapes"] == 0 and prog.router["fallbacks"] == 0
    assert all(r["turns"] > 0 for r in prog.replicas)  # placement used both replicas


def test_total_kv_is_split_evenly_and_the_default_is_a_profile_per_replica():
    assert replica_blocks(SimConfig(kv_tokens=64_000, block_size=16), 4) == 1000
    one = replica_blocks(SimConfig(), 1)
    assert replica_blocks(SimConfig(), 8) == one > 0


def test_cli_runs_replicas_by_routers_and_writes_their_rows(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["sim", "--replicas", "1,2", "--router", "program,round-robin", "--programs", "4", "--rates", "1",
                 "--policies", "agentserve", "--kv-tokens", "80000", "--jobs", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["replicas"], r["router"]) for r in rows] == [(1, "program"), (1, "round-robin"), (2, "program"),
                                                            (2, "round-robin")]
    two = rows[2]
    assert two["programs"] == 8 and two["total_rate"] == 2 and two["load_spread"] >= 1.0
    assert two["router_counters"]["placements"] == 8 and len(two["per_replica"]) == 2
    assert "load spread" in capsys.readouterr().out
    assert main(["sim", "--replicas", "2", "--router", "random"]) == 2
    assert main(["sim", "--replicas", "0"]) == 2
