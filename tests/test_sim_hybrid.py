"""The simulator on a sliding-window model: the profile's layer kinds, the cost
model's window pricing, and the KV manager with the hybrid accounting
(kv/window_parts.py) against the full one in the same bytes."""

from __future__ import annotations

import json
from dataclasses import replace
from importlib import resources

import pytest

from agentserve.cli import main
from agentserve.cost.cost_model import CostModel
from agentserve.cost.profile import ProfileError, list_profiles, load_profile, profile_from_dict
from agentserve.engine.request import Request
from agentserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from agentserve.engine.attention_shape import FULL, AttentionShape
from agentserve.sim.driver import SimConfig, SimReplica, simulate
from agentserve.sim.kv_sizing import kv_layout, replica_blocks
from agentserve.sim.report import format_markdown, ratio_lines
from agentserve.workload.generators import generate_swebench

GEMMA = "gemma3-27b-h100"
OLD = ("llama3.1-8b-h100", "llama3.1-8b-a100", "llama3.1-70b-h100x4")


# ---------------------------------------------------------------- profiles

def test_gemma_profile_has_its_layer_kinds_and_is_marked_derived():
    p = load_profile(GEMMA)
    m = p.model
    assert (m.num_layers, m.global_layers, m.window_layers, m.sliding_window) == (62, 10, 52, 1024)
    assert p.kv_bytes_per_token == 2 * 62 * 16 * 128 * 2
    assert m.window_pages == 6  # 52 window layers on pages of 10 layers, as runner/kv_cache.py lays them out
    # the same bytes: 6.2x the blocks, each of 10 layers instead of 62
    assert m.hybrid_num_blocks(p.kv_capacity_tokens, 16) == p.kv_capacity_tokens * 62 // 160
    assert "not measured" in p.description and "Derived" in p.derivation
    assert load_profile(p.name + ".json") == p


@pytest.mark.parametrize("name", [n for n in OLD if n in list_profiles()])
def test_old_profiles_load_unchanged(name):
    raw = json.loads(resources.files("agentserve.cost").joinpath(f"profiles/{name}.json").read_text())
    assert "num_global_layers" not in raw["model"] and "sliding_window" not in raw["model"]
    p = load_profile(name)
    m = p.model
    assert m.global_layers == m.num_layers and m.window_layers == 0 and m.sliding_window == 0
    assert not m.has_hybrid_layout
    data = p.to_dict()
    assert data["model"] == raw["model"]  # written back without layer-kind fields
    assert {k: data[k] for k in raw} == raw
    with pytest.raises(ValueError, match="no hybrid KV layout"):
        m.window_pages


def test_layer_kinds_are_validated():
    base = load_profile(GEMMA).to_dict()

    def with_model(**kw):
        return {**base, "model": {**base["model"], **kw}}

    with pytest.raises(ProfileError, match="num_global_layers.*more than"):
        profile_from_dict(with_model(num_global_layers=63))
    with pytest.raises(ProfileError, match="sliding_window.*exactly when"):
        profile_from_dict(with_model(sliding_window=0))
    with pytest.raises(ProfileError, match="sliding_window.*exactly when"):
        profile_from_dict(with_model(num_global_layers=62))
    with pytest.raises(ProfileError, match="model.sliding_window.*>= 0"):
        profile_from_dict(with_model(sliding_window=-4))
    # every layer windowed (Mistral-like): valid, priced, but no hybrid layout (no global layer)
    allwin = profile_from_dict(with_model(num_global_layers=0))
    assert allwin.model.window_layers == 62 and not allwin.model.has_hybrid_layout
    assert profile_from_dict(allwin.to_dict()) == allwin


# ---------------------------------------------------------------- the cost model

def _chunk(start: int, n: int) -> ScheduledChunk:
    req = Request(request_id="r", program_id="p", prompt_token_ids=[7] * (start + n), max_tokens=1,
                  arrival_time=0.0)
    return ScheduledChunk(request=req, start=start, num_tokens=n, sample=True)


def _second_difference(cm: CostModel, length: int, step: int) -> float:
    t = cm.prefill_time
    return t(length + 2 * step) - 2 * t(length + step) + t(length)


def test_a_window_layers_prefill_grows_linearly_past_its_window():
    p = load_profile(GEMMA)
    W = p.model.sliding_window
    windowed = CostModel(replace(p, model=replace(p.model, num_global_layers=0)))  # every layer windowed
    full = CostModel(replace(p, model=replace(p.model, num_global_layers=None, sliding_window=0)))
    d = 4096
    # within the window: the quadratic of full attention
    assert windowed.prefill_time(W) == pytest.approx(full.prefill_time(W))
    assert _second_difference(windowed, 0, W // 2) == pytest.approx(_second_difference(full, 0, W // 2))
    # past it: linear (each query reads W keys), where full attention keeps its 2*a*d^2
    assert _second_difference(windowed, W, d) == pytest.approx(0.0, abs=1e-12)
    assert _second_difference(full, W, d) == pytest.approx(2 * p.prefill_a_s_per_token2 * d * d)
    # a token past the window costs b plus W keys' attention, wherever it is
    marginal = windowed.prefill_time(1, 30_000) - p.step_overhead_s
    assert marginal == pytest.approx(p.prefill_b_s_per_token + p.prefill_a_s_per_token2 * 2 * W)


def test_gemma_prices_global_layers_at_the_context_and_window_layers_at_the_window():
    p = load_profile(GEMMA)
    cm = CostModel(p)
    full = CostModel(replace(p, model=replace(p.model, num_global_layers=None, sliding_window=0)))
    g, W, a = 10 / 62, 1024, p.prefill_a_s_per_token2
    assert cm.prefill_time(W) == pytest.approx(full.prefill_time(W))
    # past the window only the global share is quadratic
    assert _second_difference(cm, 8192, 8192) == pytest.approx(g * 2 * a * 8192 ** 2)
    # the true re-prefill cost at 32k: global layers quadratic, window layers linear past W
    L, b, c = 32768, p.prefill_b_s_per_token, p.step_overhead_s
    assert cm.prefill_time(L) == pytest.approx(c + b * L + a * (g * L * L + (1 - g) * W * (2 * L - W)))
    assert full.prefill_time(L) - cm.prefill_time(L) > 0.8  # seconds a full-attention pricing adds
    # chunks sum to the whole prefill (one extra c a chunk), across the window's edge
    chunks = [(0, 700), (700, 2048), (2748, 2048), (4796, 3000)]
    total = sum(cm.prefill_time(n, s) for s, n in chunks)
    assert total == pytest.approx(cm.prefill_time(7796) + 3 * p.step_overhead_s)
    # the executor's step prices a prefill chunk as prefill_time does (compute-bound)
    out = SchedulerOutput(chunks=[_chunk(20_000, 2048)])
    assert cm.forward_time(out) == pytest.approx(cm.prefill_time(2048, 20_000))
    # decode reads every global layer's KV and the window layers' last W
    kv = p.kv_read_s_per_token
    slope = cm.decode_step_time(1, 40_000) - cm.decode_step_time(1, 30_000)
    assert slope == pytest.approx(kv * g * 10_000)
    assert full.decode_step_time(1, 40_000) - full.decode_step_time(1, 30_000) == pytest.approx(kv * 10_000)
    assert cm.decode_step_time(1, 100) == pytest.approx(full.decode_step_time(1, 100))


def test_old_profiles_cost_as_before():
    p = load_profile("llama3.1-8b-h100")
    cm = CostModel(p)
    a, b, c = p.prefill_a_s_per_token2, p.prefill_b_s_per_token, p.step_overhead_s
    assert cm.prefill_time(3000, 5000) == pytest.approx(c + b * 3000 + a * (8000 ** 2 - 5000 ** 2))
    assert cm.decode_step_time(1, 9999) == pytest.approx(
        c + max(b + a * 19999, p.decode_weight_read_s + p.kv_read_s_per_token * 10000))


# ---------------------------------------------------------------- the simulator

def test_layout_choice():
    assert kv_layout(SimConfig(profile=GEMMA)) == "hybrid"  # auto: both kinds, no tier
    assert kv_layout(SimConfig(profile=GEMMA, host_tier=True)) == "hybrid"  # auto: hybrid with a host tier, as serve
    assert kv_layout(SimConfig(profile=GEMMA, kv_layout="hybrid", host_tier=True)) == "hybrid"
    assert kv_layout(SimConfig(profile=GEMMA, disk_tier=True)) == "full"
    assert kv_layout(SimConfig(profile="llama3.1-8b-h100")) == "full"
    with pytest.raises(ValueError, match="no disk KV tier"):
        kv_layout(SimConfig(profile=GEMMA, kv_layout="hybrid", disk_tier=True))
    with pytest.raises(ValueError, match="needs a model with both"):
        kv_layout(SimConfig(profile="llama3.1-8b-h100", kv_layout="hybrid"))
    with pytest.raises(ValueError, match="kv layout must be"):
        kv_layout(SimConfig(profile=GEMMA, kv_layout="paged"))
    # the same bytes: a hybrid block holds 10 of the 62 layers
    full = replica_blocks(SimConfig(profile=GEMMA, kv_layout="full", kv_tokens=40_000), 1)
    hyb = replica_blocks(SimConfig(profile=GEMMA, kv_layout="hybrid", kv_tokens=40_000), 1)
    assert (full, hyb) == (2500, 40_000 * 62 // 160)
    # the scheduler's step-time model counts attention per layer kind, as the server's does
    assert SimReplica("r", SimConfig(profile=GEMMA), 100).config.attention_shape == AttentionShape(10 / 62, 1024)
    assert SimReplica("r", SimConfig(), 100).config.attention_shape == FULL


@pytest.fixture(scope="module")
def pressured():
    """16 SWE-bench-shaped programs (contexts past 10k tokens) in 40k tokens' worth of
    Gemma 3 KV, both ways, the KV checked every 50 steps."""
    programs = generate_swebench(16, 0.2, seed=3)
    return {layout: simulate(programs, SimConfig(profile=GEMMA, policy="agentserve", kv_layout=layout,
                                                 kv_tokens=40_000, check_integrity_every=50))
            for layout in ("full", "hybrid")}


def test_hybrid_accounting_runs_with_its_kv_intact(pressured):
    full, hyb = pressured["full"], pressured["hybrid"]
    for r in (full, hyb):
        assert r.completed == r.programs == 16 and r.rejected == 0
    assert (full.kv_layout, hyb.kv_layout) == ("full", "hybrid")
    assert hyb.kv_blocks == 40_000 * 62 // 160 and full.kv_blocks == 2500
    assert hyb.window_parts_evicted > 0  # window KV no token reads was given back


def test_hybrid_retains_more_under_pressure(pressured):
    full, hyb = pressured["full"], pressured["hybrid"]
    assert hyb.hit_ratio > full.hit_ratio + 0.05
    assert sum(hyb.jct) < sum(full.jct)


def test_cli_runs_both_layouts_and_compares_them(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["sim", "--profile", GEMMA, "--kv-layout", "full,hybrid", "--policies", "agentserve",
                 "--programs", "4", "--rates", "0.5", "--kv-tokens", "40000", "--jobs", "1",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "kv layout" in text and " full " in text and " hybrid " in text
    assert "mean-JCT speedup of the hybrid KV cache over the full one: agentserve" in text
    rows = json.loads(out.read_text())
    assert [r["kv_layout"] for r in rows] == ["full", "hybrid"]
    md = format_markdown(rows)
    assert "| KV layout |" in md and "vs full KV" in md and "| hybrid |" in md
    assert any("hybrid KV cache over the full one" in line for line in ratio_lines(rows))
    assert "| done |" not in md  # every program done: no column
    rows[0]["completed"] -= 1  # the full cache could not hold one program: its mean is over fewer
    assert "| done |" in format_markdown(rows) and "| 3/4 |" in format_markdown(rows)


def test_cli_old_profile_table_has_no_layout_column(capsys):
    assert main(["sim", "--policies", "vllm-fcfs", "--programs", "2", "--rates", "0.5", "--jobs", "1"]) == 0
    assert "kv layout" not in capsys.readouterr().out


@pytest.mark.parametrize("argv, msg", [
    (["--kv-layout", "paged"], "unknown --kv-layout 'paged'"),
    (["--kv-layout", "hybrid"], "needs a model with both global and sliding-window layers"),
    (["--profile", GEMMA, "--kv-layout", "hybrid", "--disk-tier"], "no disk KV tier"),
    (["--profile", GEMMA, "--kv-layout", "full,hybrid", "--replicas", "2"], "one layout with --replicas"),
])
def test_cli_layout_errors_are_one_line(argv, msg, capsys):
    assert main(["sim", "--programs", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1


def test_hybrid_with_a_host_tier_offloads_and_reloads_with_its_kv_intact():
    """The hybrid cache over the profile's host tier in the simulator: turns go
    to the host and come back (with their windows' parts), the KV checked every
    50 steps."""
    programs = generate_swebench(16, 0.3, seed=3)
    r = simulate(programs, SimConfig(profile=GEMMA, policy="agentserve", kv_layout="hybrid", host_tier=True,
                                     kv_tokens=20_000, check_integrity_every=50))
    assert r.kv_layout == "hybrid" and r.completed == r.programs == 16 and r.rejected == 0
    assert r.tiers["offloaded"] > 0 and r.tiers["loaded"] > 0
