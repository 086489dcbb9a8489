"""Grouped prefill: a burst of requests sharing a preamble computes the shared
blocks once; followers wait for the leader's blocks and take them from the
prefix index (the fake executor checks every position they read)."""

from __future__ import annotations

import random

import pytest

from test_scheduler import BS, Harness, expected


def burst(n: int, shared: int, own: int, seed: int = 0):
    rng = random.Random(seed)
    pre = [rng.randrange(1, 200) for _ in range(shared)]
    return [pre + [rng.randrange(1, 200) for _ in range(own)] for _ in range(n)]


@pytest.mark.parametrize("group", [True, False])
def test_a_burst_sharing_a_preamble_prefills_it_once(group):
    prompts = burst(6, shared=64, own=6)
    h = Harness("vllm-fcfs", num_blocks=128, budget=256, group_prefill=group)
    reqs = [h.req(f"r{i}", f"p{i}", p, max_tokens=3) for i, p in enumerate(prompts)]
    h.run()
    for r, p in zip(reqs, prompts):
        assert r.output_token_ids == expected(p, 3)
    computed = h.s.stats.prefill_tokens
    if group:
        # the leader computes the 64 shared tokens, every request its own tail (and partial block)
        assert computed <= 64 + 6 * (6 + BS)
        assert h.s.stats.grouped_requests == 5
        assert all(r.num_cached_tokens >= 64 for r in reqs[1:])
    else:
        assert computed > 64 + 6 * (6 + BS)
        assert h.s.stats.grouped_requests == 0


def test_followers_do_not_hold_up_unrelated_requests():
    prompts = burst(3, shared=96, own=4)
    other = [7] * 10
    h = Harness("vllm-fcfs", num_blocks=128, budget=200)
    reqs = [h.req(f"r{i}", f"p{i}", p, max_tokens=2) for i, p in enumerate(prompts)]
    lone = h.req("lone", "q", other, max_tokens=2)
    h.run()
    # the unrelated request is admitted while the followers wait for the leader
    assert h.admission_order.index("lone") < h.admission_order.index("r1")
    assert lone.output_token_ids == expected(other, 2)
    assert all(r.output_token_ids == expected(p, 2) for r, p in zip(reqs, prompts))


def test_a_preempted_leader_frees_its_followers():
    prompts = burst(3, shared=48, own=5, seed=3)
    h = Harness("vllm-fcfs", num_blocks=26, budget=8)
    reqs = [h.req(f"r{i}", f"p{i}", p, max_tokens=12) for i, p in enumerate(prompts)]
    h.run()
    assert all(r.output_token_ids == expected(p, 12) for r, p in zip(reqs, prompts))


def test_burst_benchmark_on_a_tiny_model(capsys):
    from benchmarks.burst_prefill import print_table, run_burst
    from tiny_models import hf_llama, loaded

    res = run_burst(loaded(hf_llama()), agents=4, preamble=96, own=8, max_tokens=2, budgets=[512], seed=1,
                    dtype="float32", block_size=4)
    off, on = res
    assert not off.grouped and on.grouped and off.prompt_tokens == on.prompt_tokens == 4 * 104
    assert on.computed_tokens < off.computed_tokens and on.grouped_requests == 3
    print_table(res)
    assert "TTFT p99" in capsys.readouterr().out
