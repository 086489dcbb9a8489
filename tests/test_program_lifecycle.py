"""Programs on a live server: how they end (idle expiry, anonymous one-shot
requests, an end mid-turn), what that teaches the retention statistics, and
how long pins and per-program state may live."""

from __future__ import annotations

import pytest
from test_scheduler import BS, FakeExecutor, Harness, expected, prompt_of

from agentserve.clock import SimClock
from agentserve.engine.llm_engine import LLMEngine
from agentserve.engine.request import Request, RequestStatus
from agentserve.engine.sampling_params import SamplingParams
from agentserve.engine.scheduler import Scheduler, SchedulerConfig
from agentserve.kv.manager import KVCacheManager


def run_program(h: Harness, pid: str, turns: int, seed: int, last_is_final: bool = False,
                tool: str = "search", gap: float = 0.1, ttl_hint: float | None = 0.5) -> list[Request]:
    """`turns` turns of one program, each prompt the previous turn's tokens plus
    a small delta, `gap` seconds of tool time between them."""
    reqs = []
    prompt = prompt_of(seed, 9)
    for k in range(turns):
        final = last_is_final and k == turns - 1
        r = h.req(f"{pid}/{k}", pid, prompt, max_tokens=2, tool_name=None if final else tool,
                  is_last_turn=final, ttl_hint=None if final else ttl_hint)
        h.run(until=lambda: r.is_finished)
        reqs.append(r)
        h.clock.advance(gap)
        prompt = r.token_ids + prompt_of(seed * 100 + k, 3)
    return reqs


# ---------------------------------------------------------------- eta and T from live traffic


def test_idle_expired_programs_count_for_eta():
    """Clients that never end their programs: the programs idle-expire, and each
    one still counts for memoryfulness with the turns it had."""
    h = Harness("continuum", num_blocks=64, program_idle_timeout=10.0)
    for i, turns in enumerate((2, 3, 5, 4)):
        run_program(h, f"P{i}", turns, seed=i + 1)
    pol = h.s.policy
    assert len(pol.eta) == 0
    assert pol.tool_stats.pending_count() == 4  # every last turn called a tool that never returned
    h.idle(100.0)  # the pins (0.5 s) expire ...
    h.idle(1.0)  # ... and the programs, idle for longer than the timeout, end
    assert len(h.s.programs) == 0 and not h.kv.pins
    assert len(pol.eta) == 4
    assert pol.eta.num_pairs() == 1 + 2 + 4 + 3
    assert pol.eta.value() != pol.eta.prior
    assert pol.tool_stats.pending_count() == 0  # a tool that never returned is no sample
    assert pol.tool_stats.count("search") == 1 + 2 + 4 + 3
    assert h.kv.num_free_blocks == h.kv.num_blocks


def test_anonymous_one_shot_requests_do_not_push_programs_out_of_eta():
    h = Harness("continuum", num_blocks=64)
    for i, turns in enumerate((2, 3, 4)):
        run_program(h, f"P{i}", turns, seed=i + 1, last_is_final=True)
    pol = h.s.policy
    assert len(pol.eta) == 3
    eta = pol.eta.value()
    for j in range(300):  # more than eta's window of 256 programs
        h.req(f"anon{j}", f"anon{j}", prompt_of(1000 + j, 6), max_tokens=1, anonymous=True, is_last_turn=True)
    h.run()
    assert len(pol.eta) == 3 and pol.eta.value() == eta
    assert len(h.s.programs) == 0


def test_anonymous_request_is_its_own_one_turn_program():
    """Nothing can come back to a request without a program id: its KV is not
    pinned even if the client did not mark it final, and its program ends."""
    h = Harness("continuum", reload_cost=lambda n: 0.5 * n)
    r = h.req("x", "x", prompt_of(3, 18), max_tokens=3, anonymous=True, tool_name="search")
    h.run()
    assert r.is_finished and not h.kv.pins and "x" not in h.s.programs
    assert h.s.policy.tool_stats.pending_count() == 0 and len(h.s.policy.eta) == 0
    # the engine marks requests without a program id as anonymous
    clock = SimClock()
    engine = LLMEngine(Scheduler(SchedulerConfig(), KVCacheManager(16, BS), "continuum", clock),
                       FakeExecutor(clock), clock, detokenizer=lambda: _NoText())
    assert engine.add_request([1, 2, 3], SamplingParams(max_tokens=1)).anonymous
    assert not engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), program_id="p").anonymous


class _NoText:
    def push(self, token_id: int) -> str:
        return ""


# ---------------------------------------------------------------- program lookup without side effects


def test_ending_a_program_with_a_waiting_turn_keeps_its_place_and_does_not_revive_it():
    """The client ends program A while A's next turn waits: the turn keeps A's
    place (A arrived before B), finishes as A's last, and A is not re-created
    (it used to be, with the turn's arrival as the program's: behind B)."""
    h = Harness("program-fcfs", max_seqs=1)
    a1 = h.req("a1", "A", prompt_of(1, 5), max_tokens=1)
    h.run()
    h.req("blk", "Z", prompt_of(3, 5), max_tokens=30)
    h.step()
    h.clock.advance(1.0)
    h.req("b1", "B", prompt_of(2, 5), max_tokens=1)
    h.clock.advance(1.0)
    a2 = h.req("a2", "A", a1.token_ids + [1], max_tokens=1)
    h.s.end_program("A")
    h.step()
    assert "A" not in h.s.programs
    h.run()
    assert h.admission_order[-2:] == ["a2", "b1"]
    assert a2.output_token_ids == expected(a2.prompt_token_ids, 1)
    assert "A" not in h.s.programs and "A" not in h.kv.pins


def test_a_turn_running_when_its_program_ends_is_not_pinned():
    h = Harness("continuum", reload_cost=lambda n: 0.5 * n)
    r = h.req("t1", "P", prompt_of(4, 18), max_tokens=6, tool_name="search")
    h.step()
    h.s.end_program("P")
    h.run()
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert not h.kv.pins and "P" not in h.s.programs
    assert h.kv.num_free_blocks == h.kv.num_blocks


# ---------------------------------------------------------------- pin reclaim by blocks freed


def test_reclaim_skips_a_pin_that_frees_no_block():
    """LATE's pin holds only blocks a running request also holds: releasing it
    frees nothing, so a waiting request reclaims OTHER's pin instead and LATE
    keeps its retention (it used to be dropped first, as the latest program)."""
    h = Harness("continuum", num_blocks=16, max_seqs=4)
    h.req("w0", "W", prompt_of(9, 3), max_tokens=1)  # W is the oldest program
    h.run()
    h.clock.advance(1.0)
    other = h.req("o1", "OTHER", prompt_of(5, 13), max_tokens=4, tool_name="search", ttl_hint=100.0)
    h.run(until=lambda: other.is_finished)
    h.clock.advance(1.0)
    # 13 + 4 tokens, 16 computed: exactly 4 full blocks, all indexed
    late = h.req("l1", "LATE", prompt_of(6, 13), max_tokens=4, tool_name="search", ttl_hint=100.0)
    h.run(until=lambda: late.is_finished)
    assert h.kv.reclaimable_blocks("LATE") == 4 and h.kv.reclaimable_blocks("OTHER") == 4
    # a later program's request runs on LATE's whole history
    runner = h.req("run", "RUN", late.token_ids + [1, 2, 3], max_tokens=12)
    h.step()
    assert runner.num_cached_tokens == 16 and h.kv.reclaimable_blocks("LATE") == 0
    # 6 blocks, beside the 3 the runner may still take: 7 are free, so a pin must go
    assert h.kv.num_free_blocks == 7
    w = h.req("w1", "W", prompt_of(10, 20), max_tokens=2)
    h.run(until=lambda: w.is_finished)
    assert "LATE" in h.kv.pins and "OTHER" not in h.kv.pins
    assert h.s.stats.pins_reclaimed == 1
    h.run()
    assert w.output_token_ids == expected(w.prompt_token_ids, 2)
    assert runner.output_token_ids == expected(runner.prompt_token_ids, 12)


def test_reclaim_never_releases_a_pin_that_frees_nothing():
    h = Harness("continuum", num_blocks=8, max_seqs=4)
    h.req("w0", "W", prompt_of(9, 3), max_tokens=1)
    h.run()
    h.clock.advance(1.0)
    late = h.req("l1", "LATE", prompt_of(6, 13), max_tokens=4, tool_name="search", ttl_hint=100.0)
    h.run(until=lambda: late.is_finished)
    runner = h.req("run", "RUN", late.token_ids + [1, 2, 3], max_tokens=8)
    h.step()
    w = h.req("w1", "W", prompt_of(10, 14), max_tokens=2)  # does not fit beside the runner
    h.run(until=lambda: runner.is_finished)
    assert "LATE" in h.kv.pins and h.s.stats.pins_reclaimed == 0
    assert w.status is RequestStatus.WAITING
    h.run()
    assert w.output_token_ids == expected(w.prompt_token_ids, 2)


# ---------------------------------------------------------------- InferCept's pins are bounded


def test_infercept_overdue_pin_gets_a_deadline_and_its_program_expires():
    h = Harness("infercept", reload_cost=lambda n: 0.05 * n, program_idle_timeout=10.0)
    pol = h.s.policy
    for _ in range(5):
        pol.tool_stats.record("fast", 0.5)
    r = h.req("f1", "F", prompt_of(1, 18), max_tokens=3, tool_name="fast")
    h.run()
    pin = h.kv.pins["F"]
    assert pin.expiry == pytest.approx(r.finish_time + pol.deadline_factor * 0.5)
    h.idle(0.6)  # overdue: preserving costs nothing any more, but the deadline holds it
    assert "F" in h.kv.pins
    h.idle(1.0)
    assert "F" not in h.kv.pins and h.s.stats.pins_expired == 1
    h.idle(20.0)  # and the program, now idle, is forgotten with no state left behind
    assert "F" not in h.s.programs
    assert h.kv.num_free_blocks == h.kv.num_blocks


# ---------------------------------------------------------------- superseded turns


def test_a_rewritten_context_demotes_the_superseded_turn_at_once():
    """P's second turn keeps the first 2 blocks of its history and rewrites the
    rest: the moment it arrives, the rest leaves P's pin and goes to the cold
    end, so memory pressure takes it, deepest first, before Q's older and still
    useful prefix (plain LRU would take Q's first)."""
    h = Harness("continuum", num_blocks=16, budget=64)
    q = h.req("q1", "Q", prompt_of(7, 13), max_tokens=2, tool_name="search", ttl_hint=0.0)
    h.run()  # 15 tokens, 14 computed: 3 cached blocks, 1 empty; Q goes on, unpinned
    p1 = h.req("p1", "P", prompt_of(8, 18), max_tokens=4, tool_name="search", ttl_hint=100.0)
    h.run()
    assert len(h.kv.pins["P"].blocks) == 6  # 21 computed tokens: 5 full blocks and a partial one
    p2 = h.req("p2", "P", p1.token_ids[:2 * BS] + prompt_of(10, 5), max_tokens=2)
    assert h.s.stats.superseded_blocks == 3 and len(h.kv.pins["P"].blocks) == 2
    assert h.kv.num_free_blocks == 14 and h.kv.pool.num_cached_free == 6
    # p2 takes 2 empty blocks beside its 2 hits, big the 6 left and 2 evicted ones
    big = h.req("big", "N", prompt_of(11, 31), max_tokens=1)
    h.run()
    assert p2.num_cached_tokens == 2 * BS and big.is_finished
    assert h.kv.match(q.token_ids).num_tokens == 3 * BS  # Q's prefix survived
    assert h.kv.match(p1.token_ids).num_tokens == 3 * BS  # P's 2 deepest superseded blocks went
    assert p2.output_token_ids == expected(p2.prompt_token_ids, 2)


def test_a_turn_that_extends_its_history_demotes_nothing():
    h = Harness("continuum", num_blocks=64)
    run_program(h, "P", 4, seed=3, ttl_hint=100.0)
    assert h.s.stats.superseded_blocks == 0 and h.kv.pool.num_demoted == 0


# ---------------------------------------------------------------- ended programs


def test_an_ended_programs_own_chain_is_evicted_first_and_the_shared_prefix_stays():
    """A and B share a 2-block system prompt. B is between turns, unpinned, and
    freed its blocks before A ended: plain LRU would evict B's history first.
    A's end sends the blocks only A's chain holds to the cold end, so memory
    pressure takes those, deepest first, and leaves B's history and the shared
    prompt."""
    h = Harness("agentserve", num_blocks=16, budget=64)
    system = prompt_of(1, 2 * BS)
    b = h.req("b1", "B", system + prompt_of(2, 2 * BS + 1), max_tokens=2, tool_name="search", ttl_hint=0.0)
    h.run()
    a = h.req("a1", "A", system + prompt_of(3, 3 * BS + 1), max_tokens=2, is_last_turn=True)
    h.run()
    assert h.s.stats.retired_blocks == 3  # A's 3 own full blocks; the shared 2 stay where they were
    assert "A" not in h.s.programs
    assert h.kv.pool.num_cached_free == 7 and h.kv.num_free_blocks == 16
    big = h.req("big", "N", prompt_of(4, 10 * BS + 1), max_tokens=1)  # 11 blocks: 2 must be evicted
    h.run()
    assert big.is_finished and h.kv.pool.num_evictions == 2
    assert h.kv.match(b.token_ids).num_tokens == 4 * BS  # B's history survived whole
    assert h.kv.match(a.token_ids).num_tokens == 3 * BS  # A's 2 deepest own blocks went first
    h.kv.check_integrity()


def test_a_program_ended_between_turns_or_idle_retires_its_chain():
    """An end sent between turns (the pin is dropped) and an idle expiry both
    retire the program's chain; a turn still running keeps its blocks until it
    finishes, then retires them."""
    h = Harness("agentserve", num_blocks=64, program_idle_timeout=10.0)
    run_program(h, "P", 2, seed=1, ttl_hint=100.0)
    assert "P" in h.kv.pins
    h.s.end_program("P")
    assert "P" not in h.kv.pins and h.s.stats.retired_blocks > 0
    assert h.kv.pool.num_demoted == h.s.stats.retired_blocks
    before = h.s.stats.retired_blocks
    run_program(h, "Q", 2, seed=2, ttl_hint=0.0)
    h.idle(100.0)  # Q idles past the timeout and ends
    assert "Q" not in h.s.programs and h.s.stats.retired_blocks > before
    before = h.s.stats.retired_blocks
    r = h.req("r1", "R", prompt_of(5, 3 * BS + 1), max_tokens=6, tool_name="search")
    h.step()
    h.s.end_program("R")  # its turn is running: nothing of it is free yet
    assert h.s.stats.retired_blocks == before
    h.run(until=lambda: r.is_finished)
    assert h.s.stats.retired_blocks > before
    assert h.kv.num_free_blocks == h.kv.num_blocks
    h.kv.check_integrity()


def test_anonymous_requests_retire_nothing():
    """A request without a program id may be continued by a client that sends
    no id (the prefix finds its conversation), so its KV keeps its LRU place."""
    h = Harness("agentserve", num_blocks=64)
    h.req("x", "x", prompt_of(6, 3 * BS + 1), max_tokens=2, anonymous=True, is_last_turn=True)
    h.run()
    assert "x" not in h.s.programs
    assert h.s.stats.retired_blocks == 0 and h.kv.pool.num_demoted == 0


def test_policies_that_keep_vllms_order_retire_nothing():
    """continuum (paper-faithful) and agentserve:retire=off free an ended
    program's KV like any turn's: newest in eviction order."""
    for policy in ("continuum", "agentserve:retire=off"):
        h = Harness(policy, num_blocks=64)
        run_program(h, "P", 2, seed=1, last_is_final=True)
        assert "P" not in h.s.programs
        assert h.s.stats.retired_blocks == 0 and h.kv.pool.num_demoted == 0
