"""The simulator end to end: every policy completes a pressured workload with
intact KV accounting, hung tools do not deadlock, and the CLI writes what it says."""

import json
import math
from collections import defaultdict

import pytest

from agentserve.cli import main
from agentserve.policy.registry import policy_names
from agentserve.policy.tool_stats import NO_TOOL_CALL
from agentserve.policy.ttl import EtaEstimator
from agentserve.sim.driver import SimConfig, percentile, simulate
from agentserve.sim.report import ROW_KEYS
from agentserve.sim.robustness import split_hanging
from agentserve.workload.generators import generate_swebench
from agentserve.workload.trace import NON_TOOL_NAMES


@pytest.fixture(scope="module")
def small_workload():
    return generate_swebench(24, 2.0, seed=3)


@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize("host_tier", [False, True])
def test_every_policy_completes_under_memory_pressure(small_workload, policy, host_tier):
    # 60k tokens of KV for 24 programs of ~6k-token prompts: constant pressure.
    r = simulate(small_workload, SimConfig(policy=policy, kv_tokens=60_000, host_tier=host_tier,
                                           check_integrity_every=50))
    assert r.completed == len(small_workload) and r.rejected == 0
    assert all(j > 0 for j in r.jct)
    assert 0 < r.hit_ratio < 1


def test_programs_that_are_never_ended_still_teach_eta_and_tool_times():
    """Clients that never send end_program: the programs end idle, and what
    continuum learned equals the workload's truth (eta exactly; each tool's mean
    up to the step in which a returning turn is noticed), with no per-program
    state left behind."""
    programs = generate_swebench(60, 1.0, seed=4)
    r = simulate(programs, SimConfig(policy="continuum", end_programs=False))
    assert r.completed == 60
    truth = EtaEstimator()
    durations = defaultdict(list)
    for p in programs:
        truth.add_program(len(p.calls))
        for c in p.calls[:-1]:  # the last call's tool never returns: no sample
            durations[NO_TOOL_CALL if c.tool_name in (None, *NON_TOOL_NAMES) else c.tool_name].append(c.tool_duration)
    st = r.state
    assert st["eta_programs"] == 60 and st["eta"] == pytest.approx(truth.value())
    assert st["tool_means"].keys() == durations.keys()
    for tool, ds in durations.items():
        assert st["tool_means"][tool] == pytest.approx(sum(ds) / len(ds), abs=0.05), tool
    assert st["programs"] == st["pins"] == st["pending_tools"] == 0


def test_jct_includes_tool_time():
    programs = generate_swebench(3, 0.01, seed=1)  # far apart: no queueing
    r = simulate(programs, SimConfig(policy="vllm-fcfs"))
    tool_time = sorted(sum(c.tool_duration for c in p.calls) for p in programs)
    for jct, tools in zip(sorted(r.jct), tool_time):
        assert jct > tools


def test_pressure_makes_continuum_beat_end_of_turn_eviction(small_workload):
    base = simulate(small_workload, SimConfig(policy="vllm-fcfs", kv_tokens=60_000))
    cont = simulate(small_workload, SimConfig(policy="continuum", kv_tokens=60_000))
    assert cont.pins["created"] > 0 and cont.pins["hit"] > 0
    assert cont.hit_ratio > base.hit_ratio


def test_never_returning_tools_do_not_deadlock(small_workload):
    hung, healthy = split_hanging(small_workload, 0.3, seed=0)
    assert len(hung) > len(healthy)
    r = simulate(hung, SimConfig(policy="continuum", kv_tokens=60_000, check_integrity_every=50))
    assert r.completed == len(healthy)
    assert r.pins["expired"] + r.pins["reclaimed"] > 0


def test_percentile():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert math.isnan(percentile([], 90))


def test_cli_sim_writes_table_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["sim", "--workload", "swebench", "--programs", "8", "--rates", "1,2",
               "--policies", "vllm-fcfs,continuum", "--kv-tokens", "40000", "--jobs", "1",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 4
    for row in rows:
        assert set(ROW_KEYS) <= set(row)
    assert png.stat().st_size > 1000
    text = capsys.readouterr().out
    assert "continuum" in text and "mean JCT" in text


def test_cli_sim_without_end_program_shows_what_was_learned_beside_the_truth(capsys):
    rc = main(["sim", "--workload", "swebench", "--programs", "60", "--rates", "1", "--policies", "continuum",
               "--no-end-program", "--show-state", "--jobs", "1"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "per-program state left: 0 programs, 0 pins, 0 pending tool calls" in text
    line = next(ln for ln in text.splitlines() if "eta learned" in ln)
    learned, true = float(line.split()[2].rstrip(",")), float(line.split()[4])
    assert learned == pytest.approx(true, abs=1e-9)  # every program ended idle and counted
    assert "tool mean seconds, learned / true" in text


def test_true_values_follow_the_estimators_definitions():
    from agentserve.workload.trace import Program, TraceCall
    from agentserve.sim.learned import true_values

    def prog(pid, tools):
        calls = [TraceCall(pid, i, 0.0, 10, 10, 1, t, d) for i, (t, d) in enumerate(tools)]
        return Program(pid, calls)
    progs = [prog("a", [("ls", 1.0), ("cat", 3.0), (None, 0.0)]), prog("b", [("ls", 2.0), ("human", 9.0), (None, 0.0)]),
             prog("c", [("ls", 3.0), (None, 0.0)])]
    t = true_values(progs)
    assert t["tool_means"] == {"ls": 2.0, "cat": 3.0}
    from agentserve.policy.ttl import EtaEstimator
    e = EtaEstimator(window=3)
    for n in (3, 3, 2):
        e.add_program(n)
    assert t["eta"] == e.value()


@pytest.mark.parametrize("argv, msg", [
    (["sim", "--policies", "nope"], "unknown policy"),
    (["sim", "--policies", "agentserve:depth=1"], "has no option 'depth'"),
    (["sim", "--host-kv-tokens", "3"], "at least one block"),
    (["sim", "--workload", "nope"], "unknown workload"),
    (["sim", "--profile", "nope"], "nope"),
    (["sim", "--rates", "0"], "positive"),
    (["sim", "--eviction", "fifo"], "unknown eviction"),
])
def test_cli_errors_are_one_line(argv, msg, capsys):
    assert main(argv + ["--programs", "2", "--jobs", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0]


def test_step_time_target_in_the_simulator():
    """A 40k-token prompt arrives while another program decodes: uncapped, its
    2048-token chunks late in the prompt make steps of ~140 ms on the H100
    profile; with a 50 ms target the simulated scheduler learns the cost and
    cuts the chunks (the first few run at the full budget while it learns)."""
    from agentserve.workload.trace import Program, TraceCall

    def program(pid, arrival, prompt, output):
        return Program(pid, [TraceCall(pid, 0, arrival, prompt, prompt, output, None, 0.0)])

    programs = [program("decoder", 0.0, 200, 3000), program("long", 0.5, 40_000, 4)]
    off = simulate(programs, SimConfig(policy="vllm-fcfs", max_step_ms_with_decodes=None))
    on = simulate(programs, SimConfig(policy="vllm-fcfs", max_step_ms_with_decodes=50.0, check_integrity_every=50))
    assert off.completed == on.completed == 2
    assert off.capped_steps == 0 and off.decode_step_max_s > 0.12
    assert on.capped_steps > 10 and on.decode_step_max_s < 0.08


def _small_host_profile(tmp_path, **changes):
    """The default profile with a host tier small enough for the workload to overflow it."""
    from agentserve.cost.profile import load_profile

    d = load_profile("llama3.1-8b-h100").to_dict()
    d.update(host_kv_capacity_tokens=20_000, **changes)
    path = tmp_path / f"p{len(changes)}.json"
    path.write_text(json.dumps(d))
    return str(path)


def test_disk_tier_spills_host_evictions_and_reloads_them(small_workload, tmp_path):
    prof = _small_host_profile(tmp_path)
    host = simulate(small_workload, SimConfig(policy="continuum", profile=prof, kv_tokens=60_000, host_tier=True))
    disk = simulate(small_workload, SimConfig(policy="continuum", profile=prof, kv_tokens=60_000, disk_tier=True,
                                              check_integrity_every=50))
    assert disk.completed == len(small_workload)
    assert host.tiers["spilled"] == 0 and host.tiers["disk_loaded"] == 0
    assert disk.tiers["spilled"] > 0 and disk.tiers["disk_loaded"] > 0
    assert disk.hit_ratio > host.hit_ratio  # blocks the host tier dropped are found on disk
    slow = _small_host_profile(tmp_path, disk_read_bandwidth_bytes_s=1e6)
    crawl = simulate(small_workload, SimConfig(policy="continuum", profile=slow, kv_tokens=60_000, disk_tier=True))
    assert mean_jct(crawl) > mean_jct(disk)  # disk reloads are priced at the profile's SSD bandwidth


def mean_jct(r):
    return sum(r.jct) / len(r.jct)


def test_cli_sim_disk_tier(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["sim", "--workload", "swebench", "--programs", "12", "--rates", "2", "--policies", "continuum",
               "--kv-tokens", "40000", "--jobs", "1", "--disk-tier", "--profile", _small_host_profile(tmp_path),
               "--json", str(out)])
    assert rc == 0
    (row,) = json.loads(out.read_text())
    assert row["tiers"]["spilled"] > 0


def test_cost_model_prices_disk_copies_at_the_ssd_bandwidth():
    from agentserve.cost.cost_model import CostModel
    from agentserve.cost.profile import load_profile
    from agentserve.engine.scheduler_output import SchedulerOutput

    p = load_profile("llama3.1-8b-h100")
    assert p.disk_read_bandwidth_bytes_s == p.disk_write_bandwidth_bytes_s == 3e9  # the defaults
    cost = CostModel(p, block_size=16)
    block = p.kv_bytes_per_token * 16
    spill = cost.step_time(SchedulerOutput(blocks_to_spill=[(i, i) for i in range(10)]))
    assert spill == pytest.approx(10 * block / 3e9)
    load = cost.step_time(SchedulerOutput(blocks_to_load_disk=[(i, i) for i in range(10)]))
    assert load == pytest.approx(10 * block / 3e9 + cost.copy_blocks_time(10))
    assert p.disk_num_blocks(16) == int(2e12 // block)


def test_agentserve_sends_waits_only_the_disk_outlasts_on_to_disk(small_workload, tmp_path):
    """Tools 40x slower than recorded, a host tier that turns over in seconds and a
    disk tier that does not: agentserve prices those misses at the disk reload and
    puts the turns' KV first in line for the disk; everything completes intact."""
    from dataclasses import replace as dc_replace

    slow = [dc_replace(p, calls=[dc_replace(c, tool_duration=c.tool_duration * 40) for c in p.calls])
            for p in small_workload]
    prof = _small_host_profile(tmp_path)
    r = simulate(slow, SimConfig(policy="agentserve", profile=prof, kv_tokens=60_000, disk_tier=True,
                                 check_integrity_every=50))
    assert r.completed == len(slow)
    assert r.tiers["onward_turns"] > 0 and r.tiers["spilled"] > 0 and r.tiers["disk_loaded"] > 0
    off = simulate(slow, SimConfig(policy="agentserve:tiers=off", profile=prof, kv_tokens=60_000, disk_tier=True))
    assert off.tiers["onward_turns"] == 0


def test_report_renders_the_readme_table_from_a_sweeps_json(tmp_path, capsys):
    from agentserve.sim.report import main as report_main

    def row(policy, rate, jct):
        return {"policy": policy, "rate": rate, "mean_jct": jct, "p95_jct": 2 * jct, "throughput": 0.5,
                "hit_ratio": 0.5, "p99_ttft": 1.0, "max_queue": 2.0, "preemptions": 0,
                "pins": {"created": 3, "mean_ttl": 1.5}}

    path = tmp_path / "s.json"
    path.write_text(json.dumps([row("vllm-fcfs", 0.5, 200.0), row("continuum", 0.5, 100.0),
                                row("agentserve", 0.5, 80.0)]))
    assert report_main([str(path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| rate | policy | mean JCT | speedup | vs continuum")
    assert lines[4] == "| 0.5 | agentserve | **80.0** | 2.50x | 1.25x | 160.0 | 0.500 | 50.0 | 1.0 | 2.0 | 0 | 3 | 1.50 |"
    assert "| 0.5 | continuum | 100.0 | 2.00x | 1.00x |" in lines[3]
    assert report_main([str(path), "--focus", "agentserve"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[2] == "| s | 0.5 | continuum 100.0 | **80.0** | 1.25x | 1.00x |"
