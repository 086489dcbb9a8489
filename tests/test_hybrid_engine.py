"""The hybrid KV cache through the whole engine, on tiny random Gemma 3 models
(window 8, blocks of 4): greedy output equal to the full cache's and to
transformers', token for token, over multi-turn programs that cross many
windows, with prefix hits, preemption and part eviction under pressure; the
layout of layers onto blocks; and what a long conversation holds each way."""

from __future__ import annotations

import pytest

from agentserve.engine.sampling_params import SamplingParams
from agentserve.llm import LLM
from agentserve.runner.kv_cache import HybridLayout, kv_layout_for
from tiny_models import DEVICE, hf_gemma3, hf_greedy, loaded_as, prompt, save_hf_folder

LAYERS = {"3 layers": None, "5 layers, 2 global": ["sliding_attention", "sliding_attention", "full_attention",
                                                   "sliding_attention", "full_attention"]}


def make(hf, layout: str, **kw) -> LLM:
    opts = dict(dtype="float32", device=DEVICE, kv_cache_tokens=4096, block_size=4, max_num_batched_tokens=64,
                policy="vllm-fcfs", speculate=0, kv_layout=layout)
    opts.update(kw)
    return LLM(loaded_as(hf, "gemma3"), **opts)


@pytest.fixture(scope="module", params=list(LAYERS))
def hf(request):
    return hf_gemma3(layer_types=LAYERS[request.param])


def conversation(llm: LLM, programs: int = 3, turns: int = 4) -> list[list[int]]:
    """Programs that each grow a conversation turn by turn (the last reply and
    a few new tokens appended); returns every turn's output tokens, in order."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    history = {f"p{i}": prompt(40 + i, 20 + 7 * i) for i in range(programs)}
    outs = []
    for t in range(turns):
        pids = sorted(history)
        got = llm.generate([history[p] for p in pids], params, program_ids=pids)
        for p, o in zip(pids, got):
            outs.append(o.token_ids)
            history[p] = history[p] + o.token_ids + prompt(90 + t, 5)
        llm.check_integrity()
    return outs


def test_multi_turn_programs_equal_the_full_cache_and_transformers(hf):
    full = conversation(make(hf, "full"))
    llm = make(hf, "hybrid")
    assert llm.kv_cache.layout is not None
    hybrid = conversation(llm)
    assert hybrid == full
    assert llm.scheduler.stats.hit_tokens > 200  # later turns hit their history
    # the last turn's prompts (up to ~160 tokens, 20 windows) against transformers
    p = prompt(40, 20)
    ref_llm = make(hf, "hybrid")
    out = ref_llm.generate([p], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, p, 48)


def test_under_pressure_preemption_and_part_eviction_change_no_token(hf):
    full = conversation(make(hf, "full"), programs=4, turns=3)
    llm = make(hf, "hybrid", kv_cache_tokens=160)
    assert conversation(llm, programs=4, turns=3) == full
    assert llm.scheduler.stats.preemptions > 0
    assert llm.kv.parts.num_evicted > 0
    # what /metrics shows of it
    from agentserve.policy.toolcall_stream import ValidatorCounts
    from agentserve.server.engine_snapshot import take_snapshot
    from agentserve.server.metrics import _SnapshotCollector
    metrics = _SnapshotCollector("m")
    metrics.snapshot = snap = take_snapshot(llm.scheduler, ValidatorCounts())
    assert snap.window_part_blocks == llm.kv_cache.layout.pages
    assert snap.window_parts == llm.kv.parts.num_parts >= snap.window_parts_unheld
    values = {s.name: s.value for fam in metrics.collect() for s in fam.samples}
    assert values["agentserve:kv_window_parts_evicted_total"] == llm.kv.parts.num_evicted


def test_a_hit_whose_window_was_evicted_stops_short_and_recomputes(hf):
    llm = make(hf, "hybrid")
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    p1 = prompt(5, 60)
    first = llm.generate([p1], params, program_ids=["A"])[0]
    turn2 = p1 + first.token_ids[:12] + prompt(6, 4)
    assert llm.kv.match(turn2).num_tokens == 72  # the turn ended: its parts are unheld, still there
    while llm.kv.parts.num_free_pages:  # pressure takes them (nothing holds them: no pin under vllm-fcfs)
        llm.kv.parts.evict_one()
    assert llm.kv.match(turn2).num_tokens == 0  # the global blocks are cached, but no window to go on from
    out = llm.generate([turn2], params, program_ids=["A"])[0]
    assert out.num_cached_tokens == 0
    assert out.token_ids == hf_greedy(hf, turn2, 20)
    llm.check_integrity()


def test_compacted_turns_hit_the_system_prompt_and_change_no_token(hf):
    """A program that compacts its conversation every turn (the system prompt, then a
    new summary, as Claude Code near its context limit), with another program's turns
    in between, in a small cache. The first compacted turn leaves the old chain at
    the system prompt's end, where no window part is left (a prompt computed in one
    chunk keeps none but its last window's); it keeps that window, and its blocks,
    which have their parts, take the cached ones' place. So every later compacted
    turn hits the whole system prompt, and every answer equals the full cache's and
    transformers'."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    system = prompt(7, 60)
    turns = [system + prompt(100, 40)] + [system + prompt(100 + t, 12) for t in range(1, 5)]

    def replay(llm):
        outs, hits = [], []
        for t, p in enumerate(turns):
            out = llm.generate([p], params, program_ids=["A"])[0]
            outs.append(out.token_ids)
            hits.append(out.num_cached_tokens)
            llm.generate([prompt(200 + t, 120)], params, program_ids=["B"])
            llm.check_integrity()
        return outs, hits

    full, _ = replay(make(hf, "full", kv_cache_tokens=160))
    llm = make(hf, "hybrid", kv_cache_tokens=160)
    outs, hits = replay(llm)
    assert outs == full
    assert outs[3] == hf_greedy(hf, turns[3], 8)
    assert hits[:2] == [0, 0] and hits[2:] == [60, 60, 60], hits  # the system prompt's 15 full blocks


def test_hybrid_holds_a_long_conversation_in_fewer_blocks(hf):
    """The same KV bytes: the hybrid pool has more, smaller blocks and a long
    conversation pinned between turns takes a fraction of them."""
    full, hyb = make(hf, "full", kv_cache_tokens=1024), make(hf, "hybrid", kv_cache_tokens=1024)
    assert full.kv_cache.bytes == hyb.kv_cache.bytes
    layout = hyb.kv_cache.layout
    long_prompt = prompt(3, 300)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    used = []
    for llm in (full, hyb):
        llm.generate([long_prompt], params)
        # the finished request's blocks stay cached; what a turn holds is all but the unheld parts
        cached = sum(1 for b in llm.kv.pool.blocks if b.node is not None)
        parts = 0 if llm.kv.parts is None else llm.kv.parts.num_parts
        used.append((cached + layout.pages * parts) / llm.kv.num_blocks)
    assert used[1] < used[0] / 1.5, used


def test_layout_of_layers_onto_blocks():
    lay = HybridLayout.of([8, None, 8, 8, None, 8, 8])
    assert (lay.window, lay.slots, lay.pages) == (8, 2, 3)
    assert lay.group == (1, 0, 1, 2, 0, 2, 3)
    assert lay.slot == (0, 0, 1, 0, 1, 1, 0)
    # every (slot, group) once
    assert len(set(zip(lay.slot, lay.group))) == 7
    assert HybridLayout.of([None, None]) is None  # no window layer
    assert HybridLayout.of([8, 8]) is None  # every layer windowed: the full cache serves it
    assert HybridLayout.of([8, None, 16]) is None  # two windows


def test_layout_choices_and_refusals():
    windows = [8, None, 8]
    assert kv_layout_for("auto", windows, disk=False) is not None
    assert kv_layout_for("full", windows, disk=False) is None
    assert kv_layout_for("auto", windows, disk=True) is None
    with pytest.raises(ValueError, match="no disk KV tier"):
        kv_layout_for("hybrid", windows, disk=True)
    with pytest.raises(ValueError, match="1 global and 0 window layers"):
        kv_layout_for("hybrid", [None], disk=False)
    with pytest.raises(ValueError, match="auto, hybrid or full"):
        kv_layout_for("paged", windows, disk=False)


def test_estimated_reprefill_cost_counts_attention_within_windows(hf, tmp_path, monkeypatch):
    """Without a profile, the TTL model's re-prefill cost of r tokens grows with
    the attention those tokens read: full on the global layers, up to the
    window on the others (no tokens-times-a-constant)."""
    from agentserve.engine.attention_shape import AttentionShape
    from agentserve.runner.profiling import tier_costs_for

    monkeypatch.setenv("HOME", str(tmp_path))  # no saved profile
    llm = make(hf, "hybrid")
    prefill, _ = tier_costs_for(None, llm)
    shape = AttentionShape.of(llm.model.windows)
    assert 0 < shape.global_share < 1
    # prefill(n) = alpha * n + beta * pairs(n): fitted on two lengths, it gives the third exactly
    p1, p2 = shape.pairs(0, 1000), shape.pairs(0, 2000)
    beta = (prefill(2000) - 2 * prefill(1000)) / (p2 - 2 * p1)
    alpha = (prefill(1000) - beta * p1) / 1000
    assert alpha > 0 and beta > 0
    assert prefill(30000) == pytest.approx(alpha * 30000 + beta * shape.pairs(0, 30000), rel=1e-9)
    assert prefill(30000) > 30 * prefill(1000)  # more than linear: attention grows with the context


def test_a_match_that_lost_its_window_is_recomputed_not_answered(hf, caplog):
    """A prefix match that reaches past the window parts still present (here a
    match that skipped the check, as a bug would) is caught at admission,
    before any KV changed hands: logged with its program and layer kind, and
    the prompt recomputed."""
    llm = make(hf, "hybrid")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    p1 = prompt(9, 50)
    first = llm.generate([p1], params, program_ids=["B"])[0]
    while llm.kv.parts.num_free_pages:
        llm.kv.parts.evict_one()
    kv, real_match = llm.kv, llm.kv.match

    def unchecked_match(tokens, salt=None, hint=None):
        parts, kv.parts = kv.parts, None
        try:
            return real_match(tokens, salt, hint)
        finally:
            kv.parts = parts

    kv.match = unchecked_match
    turn2 = p1 + first.token_ids + prompt(10, 3)
    with caplog.at_level("WARNING"):
        out = llm.generate([turn2], params, program_ids=["B"])[0]
    assert "program B: window layers:" in caplog.text and "recomputed" in caplog.text
    assert out.num_cached_tokens == 0
    assert out.token_ids == hf_greedy(hf, turn2, 12)
    llm.check_integrity()


@pytest.mark.parametrize("overlap", [False, True])
def test_host_tier_offloads_and_reloads_with_window_parts_change_no_token(hf, overlap):
    """A small device cache over a host tier, with preemption: blocks and parts
    evicted to the host come back with their windows' parts, the copies run in
    the step or beside it (`overlap_copies`); every token equals the full
    cache's (which test_multi_turn_programs_equal_the_full_cache_and_transformers
    holds to transformers')."""
    full = conversation(make(hf, "full"), programs=4, turns=4)
    llm = make(hf, "hybrid", kv_cache_tokens=160, host_kv_tokens=4096, overlap_copies=overlap)
    assert llm.kv_cache.layout is not None  # a host tier keeps the hybrid layout
    assert llm.kv_cache.host_kv.shape[2] == llm.kv_cache.layout.slots  # host slots of a pool block's layers
    assert conversation(llm, programs=4, turns=4) == full
    tier = llm.kv.window_tier
    assert tier.num_stored > 0 and tier.num_reloaded > 0
    assert llm.scheduler.stats.hit_tokens > 100 and llm.scheduler.stats.preemptions > 0
    llm.check_integrity()


def test_failed_host_reloads_of_window_parts_are_recomputed(hf, monkeypatch):
    """Every other reload batch fails: the requests it was for are cut back to
    where their window is whole and recompute; no token changes."""
    full = conversation(make(hf, "full"), programs=4, turns=3)
    llm = make(hf, "hybrid", kv_cache_tokens=160, host_kv_tokens=4096)
    real_load, calls = llm.kv_cache.load, []

    def flaky_load(pairs):
        calls.append(len(pairs))
        return list(range(len(pairs))) if len(calls) % 2 else real_load(pairs)

    monkeypatch.setattr(llm.kv_cache, "load", flaky_load)
    assert conversation(llm, programs=4, turns=3) == full
    assert llm.scheduler.stats.reload_failed_blocks > 0
    llm.check_integrity()


def test_serve_builds_the_hybrid_cache_with_a_host_tier(hf, tmp_path):
    """What `agentserve serve` builds from its flags: `--kv-layout auto` or `hybrid` with
    `--host-kv-tokens` starts the hybrid cache with its host tier; a disk tier is
    refused under hybrid in one line."""
    from agentserve.cli import build_parser
    from agentserve.cli_errors import CliError
    from agentserve.cli_model import build_llm

    folder = tmp_path / "model"
    save_hf_folder(hf, folder)
    base = ["serve", "--model", str(folder), "--device", DEVICE, "--dtype", "float32", "--block-size", "4",
            "--kv-cache-tokens", "1024", "--host-kv-tokens", "2048"]
    for layout in ("auto", "hybrid"):
        llm = build_llm(build_parser().parse_args([*base, "--kv-layout", layout]))
        assert llm.kv_cache.layout is not None and llm.kv.window_tier is not None
        # the host tier has the bytes of 2048 tokens of every layer, in the hybrid layout's blocks
        assert llm.kv.host.num_slots * llm.kv_cache.layout.slots * 4 == 2048 * llm.config.num_layers
        out = llm.generate([prompt(3, 30)], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
        assert len(out.token_ids) == 4
    disk = ["--disk-kv-bytes", "1000000", "--disk-kv-dir", str(tmp_path / "disk")]
    with pytest.raises(CliError, match="no disk KV tier"):
        build_llm(build_parser().parse_args([*base, "--kv-layout", "hybrid", *disk]))
