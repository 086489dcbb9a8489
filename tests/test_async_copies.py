"""Tier copies overlapped with compute: the scheduler over an executor whose
copies land steps after the step that queued them (as a copy engine's do).

The fake executor of test_scheduler.py checks the KV every chunk reads; here
its copies run late, in the order given, an offload reading its device block
when handed over (a snapshot), a reload writing its device block when it
lands. So a request computed before its own reloads landed, or a block reused
while a reload still writes it, shows up as wrong KV. Injected failures leave
junk where a copy was to write: nothing may ever read it."""

from __future__ import annotations

import dataclasses
import random
from collections import deque

import pytest
from test_scheduler import FakeExecutor, Harness, expected, prompt_of

from agentserve.engine.executor import CopiesDone, ExecutorResult
from agentserve.engine.scheduler_output import SchedulerOutput

NO_COPIES = dict(blocks_to_offload=[], blocks_to_load=[], blocks_to_spill=[], blocks_to_load_disk=[])


class LaggingExecutor(FakeExecutor):
    """Each step's copies land `lag` steps later (or when polled with a wait)."""

    def __init__(self, clock, lag: int = 2) -> None:
        super().__init__(clock)
        self.lag = lag
        self.flight: deque = deque()  # [steps left, output, offload snapshots]
        self.done: list[CopiesDone] = []
        self.landed_at: dict[int, int] = {}  # ticket -> the step count when it landed
        self.steps = 0

    def execute(self, out: SchedulerOutput) -> ExecutorResult:
        if out.has_copies:
            snap = [list(self.dev.get(d, [None] * self.bs)) for d, _ in out.blocks_to_offload]
            self.flight.append([self.lag, out, snap])
        res = super().execute(dataclasses.replace(out, **NO_COPIES))
        res.copies_pending = out.has_copies
        self.steps += 1
        for entry in self.flight:
            entry[0] -= 1
        while self.flight and self.flight[0][0] <= 0:
            self._land()
        return res

    def _land(self) -> None:
        _, out, snap = self.flight.popleft()
        failed_off = []
        for i, (d, h) in enumerate(out.blocks_to_offload):
            bad = self.fail_offload is not None and self.fail_offload((d, h))
            self.host[h] = ["junk"] * self.bs if bad else snap[i]
            if bad:
                failed_off.append(i)
        failed_ld = self._load(out.blocks_to_load)
        self.done.append(CopiesDone(out.copy_ticket, failed_off, failed_ld))
        self.landed_at[out.copy_ticket] = self.steps

    def poll_copies(self, wait: float = 0.0) -> list[CopiesDone]:
        if wait and not self.done and self.flight:
            self._land()
        done, self.done = self.done, []
        return done


class LaggingHarness(Harness):
    def __init__(self, policy: str = "vllm-fcfs", lag: int = 2, **kw) -> None:
        super().__init__(policy, overlap_copies=True, **kw)
        self.ex = LaggingExecutor(self.clock, lag)

    def step(self):
        s = self.s
        if s.copies_in_flight:
            s.copies_done(self.ex.poll_copies())
            s.check_integrity()
        out, fin = super().step()
        if out.is_empty and s.copies_in_flight:
            s.copies_done(self.ex.poll_copies(wait=1.0))
            s.check_integrity()
        return out, fin


def _evicted_turn(h: Harness):
    """Program P's first turn, then a filler that evicts its blocks to the host tier."""
    r1 = h.req("t1", "P", prompt_of(1, 18), max_tokens=5)
    h.run()
    h.req("f", "Q", prompt_of(2, h.kv.num_blocks * 4 - 2), max_tokens=1)  # takes every block
    h.run()
    h.run(until=lambda: not h.s.copies_in_flight)
    assert h.kv.match(r1.token_ids + [1]).num_host_blocks == 5
    return r1


def test_a_request_waits_for_its_own_reloads_while_another_computes():
    h = LaggingHarness(num_blocks=12, host=16, lag=3)
    r1 = _evicted_turn(h)
    other = h.req("o", "O", prompt_of(3, 3), max_tokens=12)
    h.step()  # `other` is admitted and computes
    r2 = h.req("t2", "P", r1.token_ids + [1, 2, 3], max_tokens=2)
    out, _ = h.step()
    assert len(out.blocks_to_load) == 5 and r2.num_loaded_tokens == 20
    assert [c.request for c in out.chunks] == [other]  # admitted, but it waits for its reloads
    ticket = out.copy_ticket
    for _ in range(2):  # the reloads land in the executor `lag` (3) steps after it was handed them
        assert h.kv.loads_pending(r2.block_table)
        out, _ = h.step()
        assert [c.request for c in out.chunks] == [other]  # `other` decodes on meanwhile
    assert ticket in h.ex.landed_at
    out, _ = h.step()  # the scheduler learns it before the next step
    assert r2 in [c.request for c in out.chunks]  # computes once they landed, beside `other`
    assert out.chunks[0].request is other
    h.run()
    assert r2.output_token_ids == expected(r2.prompt_token_ids, 2)
    assert other.output_token_ids == expected(other.prompt_token_ids, 12)
    assert h.kv.num_free_blocks == h.kv.num_blocks


def test_with_nothing_else_to_run_the_engine_waits_for_the_copies():
    h = LaggingHarness(num_blocks=8, host=16, lag=50)
    r1 = _evicted_turn(h)
    r2 = h.req("t2", "P", r1.token_ids + [1, 2, 3], max_tokens=2)
    steps = h.run()
    assert steps < 20  # an empty step polls with a wait instead of spinning for 50 steps
    assert r2.output_token_ids == expected(r2.prompt_token_ids, 2)


def test_an_aborted_request_leaves_its_reload_blocks_to_the_reload():
    """Aborted while its reloads are in flight: the reload keeps the device blocks
    (nobody else can get them while the copy writes them) and, once landed, they
    are cached like any reloaded block: the next turn hits them on the device."""
    h = LaggingHarness(num_blocks=12, host=16, lag=3)
    r1 = _evicted_turn(h)
    prompt = r1.token_ids + [1, 2, 3]
    r2 = h.req("t2", "P", prompt, max_tokens=2)
    h.step()
    loading = [b for b in r2.block_table.blocks if h.kv.is_loading(b)]
    assert len(loading) == 5
    h.s.abort("t2")
    h.s.check_integrity()
    assert all(b.ref_cnt == 1 for b in loading)  # held by the reload alone
    assert h.kv.num_free_blocks == h.kv.num_blocks - 5
    h.run(until=lambda: not h.s.copies_in_flight)
    h.s.check_integrity()
    assert h.kv.num_free_blocks == h.kv.num_blocks
    m = h.kv.match(prompt)
    assert m.num_tokens == 20 and m.num_host_blocks == 0  # on the device again
    r3 = h.req("t3", "P", prompt, max_tokens=2)
    h.run()
    assert r3.output_token_ids == expected(prompt, 2) and r3.num_loaded_tokens == 0


def test_a_failed_reload_cuts_back_only_its_own_request():
    h = LaggingHarness(num_blocks=12, host=16, lag=2)
    r1 = _evicted_turn(h)
    other = h.req("o", "O", prompt_of(3, 3), max_tokens=8)
    h.step()
    h.ex.fail_load = lambda pair: True
    r2 = h.req("t2", "P", r1.token_ids + [1, 2, 3], max_tokens=2)
    h.step()
    assert r2.block_table is not None and h.kv.loads_pending(r2.block_table)
    h.run(until=lambda: not h.kv.loads_pending(r2.block_table))
    h.ex.fail_load = None
    assert h.s.stats.reload_failed_blocks == 5
    assert h.kv.copies.num_failed == 5
    h.run()
    assert r2.output_token_ids == expected(r2.prompt_token_ids, 2)
    assert other.output_token_ids == expected(other.prompt_token_ids, 8)
    assert h.kv.num_free_blocks == h.kv.num_blocks


@pytest.mark.parametrize("lag", [1, 3])
@pytest.mark.parametrize("seed", range(4))
def test_failed_async_copies_never_hand_out_unwritten_kv(seed, lag):
    """As test_scheduler's failed-copies test, with the copies landing late:
    some offloads and reloads fail and leave junk; every chunk reads its own
    KV (the executor checks), outputs are the expected ones, nothing leaks."""
    rng = random.Random(seed)
    h = LaggingHarness(num_blocks=12, host=24, budget=16, lag=lag)
    h.ex.fail_load = lambda pair: rng.random() < 0.4
    h.ex.fail_offload = lambda pair: rng.random() < 0.2
    reqs = []
    for turn in range(4):
        for p in range(3):
            prev = next((r for r in reversed(reqs) if r.program_id == f"P{p}"), None)
            prompt = (prev.token_ids if prev else prompt_of(p, 9)) + prompt_of(100 * turn + p, 3)
            reqs.append(h.req(f"r{turn}{p}", f"P{p}", prompt, max_tokens=3))
            if rng.random() < 0.5:
                h.run()
    h.run()
    h.run(until=lambda: not h.s.copies_in_flight)
    assert h.s.stats.reload_failed_blocks > 0 and h.s.stats.loaded_tokens > 0
    for r in reqs:
        assert r.output_token_ids == expected(r.prompt_token_ids, 3)
    assert h.kv.num_free_blocks == h.kv.num_blocks
    assert not h.kv.host.pending


def test_preemption_with_swap_while_copies_are_in_flight():
    """Preempted requests swap to the host tier while earlier copies are still in
    flight; their reloads come back later; outputs still match."""
    h = LaggingHarness(num_blocks=16, host=32, lag=2)
    h.s.policy.swap_on_preempt = lambda req: True
    reqs = [h.req(f"r{i}", f"p{i}", prompt_of(i, 8), max_tokens=24) for i in range(4)]
    h.run()
    assert h.s.stats.preemptions >= 1
    assert any(o.blocks_to_offload for o in h.outputs)
    for r in reqs:
        assert r.output_token_ids == expected(r.prompt_token_ids, 24)
    h.run(until=lambda: not h.s.copies_in_flight)
    assert h.kv.num_free_blocks == h.kv.num_blocks


def test_a_step_that_raises_after_handing_over_its_copies():
    """copies_lost fails the step's batch; the executor's later report of it is ignored."""
    h = LaggingHarness(num_blocks=8, host=16, lag=2)
    r1 = _evicted_turn(h)
    r2 = h.req("t2", "P", r1.token_ids + [1, 2, 3], max_tokens=2)
    out = h.s.schedule()
    assert out.blocks_to_load
    h.ex.execute(out)  # handed over ...
    h.s.copies_lost(out)  # ... and the step failed after all
    h.s.abort(r2.request_id)
    h.s.check_integrity()
    assert h.kv.host.num_used == 0
    h.run(until=lambda: not h.ex.flight)
    h.s.copies_done(h.ex.poll_copies())  # the late report of a batch already failed: ignored
    h.s.check_integrity()
    assert h.kv.num_free_blocks == h.kv.num_blocks
