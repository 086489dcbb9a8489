"""A prefetch's disk -> host stage (kv/stage_copies.py, engine/prefetch.py): the
KV side over test_disk_tier.py's fake executor, which tracks every block's
content through the tiers (a stage that read the wrong file shows up as wrong
KV), and the engine's plan over a scheduler whose fake executor runs every
tier's copies on such contents."""

from __future__ import annotations

import math
import random

import pytest
from test_disk_tier import BS, Tiers, mk, seq
from test_scheduler import FakeExecutor, expected, prompt_of, tok_fn

from agentserve.clock import SimClock
from agentserve.engine.executor import ExecutorResult, readable, run_all_copies
from agentserve.engine.scheduler import Scheduler
from agentserve.engine.scheduler_config import SchedulerConfig
from agentserve.kv.manager import KVCacheManager
from agentserve.kv.prefetch_loads import chain_reload, stage_blocks
from agentserve.policy.prefetch import stage_start
from agentserve.engine.request import Request


def _on_disk(t: Tiers, tag: int = 1) -> list:
    for k in range(1, 4):  # device -> host -> disk, as in test_disk_tier
        t.run(seq(k))
    path = t.kv.index.walk(seq(tag))
    assert all(n.block is None and n.host_slot is None and t.kv.disk.readable(n) for n in path)
    return path


def _land_stages(t: Tiers, fail=()) -> None:
    t.ticket += 1
    pairs = t.kv.take_stages(t.ticket)
    for i, (d, h) in enumerate(pairs):
        if i not in fail:
            t.host[h] = t.disk[d]
    t.kv.finish_copies(ticket=t.ticket, tier="disk", failed_stages=fail)


def test_a_staged_chain_is_reloaded_from_the_host_tier_with_its_own_kv():
    t = mk()
    kv = t.kv
    path = _on_disk(t)
    nodes = stage_blocks(kv, path)
    assert nodes == path and kv.stages.stage(nodes) == nodes
    kv.check_integrity()
    assert stage_blocks(kv, path) == [] and chain_reload(kv, path) is None  # under way: not copied twice
    assert kv.match(seq(1)).num_tokens == 0  # not matched through a copy under way
    _land_stages(t)
    kv.check_integrity()
    assert all(kv.host.readable(n) and kv.disk.readable(n) for n in path)  # both copies now
    assert t.run(seq(1)) == (2, 2, 0)  # the host link, not the disk (Tiers.run checks the KV)


def test_a_failed_stage_drops_both_copies_and_the_turn_recomputes():
    t = mk()
    path = _on_disk(t)
    t.kv.stages.stage(stage_blocks(t.kv, path))
    _land_stages(t, fail=(0, 1))
    t.kv.check_integrity()
    assert all(n.host_slot is None and n.disk_slot is None for n in path)
    assert t.run(seq(1)) == (0, 0, 0)


def test_a_stage_in_flight_is_never_evicted_from_either_tier():
    t = mk(host=2, disk=4)
    kv = t.kv
    path = _on_disk(t)
    kv.stages.stage(stage_blocks(kv, path))
    for tag in range(4, 9):  # host and disk churn while the stage is under way
        t.run(seq(tag))
        assert all(n.host_slot is not None and n.disk_slot is not None for n in path)
    _land_stages(t)
    assert t.run(seq(1)) == (2, 2, 0)


def test_a_full_host_tier_of_copies_under_way_gives_no_stage():
    t = mk(host=2, disk=4)
    kv = t.kv
    path = _on_disk(t)
    assert kv.stages.stage(stage_blocks(kv, path)) == path  # one chain's stages hold the whole host tier
    for k in (2, 3):
        t.run(seq(k))
    q = [n for n in kv.index.walk(seq(2)) if kv.stages.stageable(n)] + \
        [n for n in kv.index.walk(seq(3)) if kv.stages.stageable(n)]
    assert q and kv.stages.stage(q) == []  # both host slots are held by the stage
    kv.check_integrity()


class StageTiers(Tiers):
    """Tiers whose batches carry the stages too, run on the disk part after its
    spills and disk reloads, as the runner's disk link runs them."""

    def __init__(self, kv, lag=0, disk_lag=0):
        super().__init__(kv, lag, disk_lag)
        self.stage_q: dict[int, list] = {}

    def step(self, **fail):
        self.stage_q[self.ticket + 1] = self.kv.take_stages(self.ticket + 1)
        return super().step(**fail)

    def _write_disk(self, part):
        bad = super()._write_disk(part)
        for d, h in self.stage_q.pop(part[0]):
            self.host[h] = self.disk[d]
        return bad


@pytest.mark.parametrize("seed", range(4))
def test_random_stages_keep_every_tier_consistent(seed):
    rng = random.Random(seed)
    lag, disk_lag = rng.choice([(0, 0), (1, 0), (2, 0), (0, 2), (1, 3)])
    t = StageTiers(KVCacheManager(3, BS, host_blocks=3, disk_blocks=6), lag, disk_lag)
    kv = t.kv
    staged = 0
    for _ in range(80):
        tag = rng.randint(1, 6)
        if rng.random() < 0.4:
            staged += len(kv.stages.stage(stage_blocks(kv, kv.index.walk(seq(tag)))))
            if rng.random() < 0.5:
                t.step()
        else:
            t.run(seq(tag))  # checks every reused block's KV
        kv.check_integrity()
    t.step()
    while t.in_flight:
        t.land()
    kv.check_integrity()
    assert staged and kv.stages.num_staged == staged
    assert not kv.stages.staging and not kv.host.pending


def test_the_stage_lead_time_prices_the_host_room_by_its_turnover():
    d = [5.0] * 20
    s, v = stage_start(d, 0.45, 3.0)
    assert s == pytest.approx(4.55) and v == pytest.approx(0.45 * (1 - 0.15))
    assert stage_start(d, 0.45, 0.4) is None  # evicted sooner than the read pays
    assert stage_start(d, 0.45, math.inf)[0] == pytest.approx(0.0)  # a host tier that never turns over
    assert stage_start(d, 0.45, 0.0) is None


# --- the engine ---

TOOL = "t"


class TierExecutor(FakeExecutor):
    """test_scheduler.py's executor with a disk: every tier's copies in the step,
    on contents, in the order the runner runs them."""

    def __init__(self, clock, bs, step_time=0.01):
        super().__init__(clock, bs, step_time)
        self.disk: dict[int, list] = {}
        self.staged = 0

    def _spill(self, pairs):
        for h, d in pairs:
            self.disk[d] = list(self.host[h])
        return []

    def _load_disk(self, pairs):
        for d, b in pairs:
            self.dev[b] = list(self.disk[d])
        return []

    def _stage(self, pairs):
        self.staged += len(pairs)
        for d, h in pairs:
            self.host[h] = list(self.disk[d])
        return []

    def execute(self, out):
        res, unloaded = run_all_copies(out, self._offload, self._load, self._spill, self._load_disk, self._stage)
        bs = self.bs
        for ch in readable(out.chunks, unloaded):
            req, table = ch.request, ch.request.block_table.block_ids
            for pos in range(ch.start):
                assert self.dev[table[pos // bs]][pos % bs] == req.token_ids[pos], f"wrong KV at {pos}"
            for pos in range(ch.start, ch.start + ch.num_tokens):
                self.dev.setdefault(table[pos // bs], [None] * bs)[pos % bs] = req.token_ids[pos]
            if ch.sample:
                res.sampled[req.request_id] = [tok_fn(req.token_ids)]
        res.elapsed = self.step_time
        self.clock.advance(res.elapsed)
        return res


class DiskHarness:
    def __init__(self, num_blocks=12, host=6, disk=32, durations=(5.0,) * 150):
        self.clock = SimClock()
        self.kv = KVCacheManager(num_blocks, 4, host_blocks=host, disk_blocks=disk)
        self.s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16), self.kv, "agentserve",
                           self.clock)
        self.ex = TierExecutor(self.clock, 4)
        self.s.policy.stage = True  # agentserve:stage=on
        ctx = self.s.policy.ctx
        ctx.tier_reload = {"host": lambda n: 0.05, "disk": lambda n: 0.5}
        ctx.tier_residency = lambda tier: 3.0 if tier == "host" else math.inf  # the KV is expected on disk
        for d in durations:
            self.s.policy.tool_stats.record(TOOL, d)

    def req(self, rid, pid, prompt, max_tokens=2, **kw):
        r = Request(rid, pid, list(prompt), max_tokens, arrival_time=self.clock.now(), **kw)
        self.s.add_request(r)
        return r

    def step(self):
        out = self.s.schedule()
        self.s.check_integrity()
        fin = self.s.update(out, self.ex.execute(out)) if not out.is_empty else []
        self.s.check_integrity()
        return out, fin

    def run(self, until=None):
        for _ in range(2000):
            if (until() if until is not None else not self.s.has_work):
                return
            self.step()
        raise AssertionError("no progress")

    def idle_to(self, t):
        while self.clock.now() < t:
            self.clock.advance(min(0.01, t - self.clock.now()))
            self.step()


def _to_disk(h: DiskHarness):
    """P's first turn calls the tool; two other programs push its KV down to disk."""
    r1 = h.req("t1", "P", prompt_of(1, 18), max_tokens=5, ttl_hint=0.0)
    r1.tool_name = TOOL
    h.run()
    for i, n in enumerate((46, 46)):
        h.req(f"f{i}", f"Q{i}", prompt_of(10 + i, n), max_tokens=1, ttl_hint=0.0)
        h.run()
    for i in range(2):
        h.s.end_program(f"Q{i}")  # (no plan of theirs in the way)
    path = h.kv.index.walk(r1.token_ids)
    assert path and all(n.block is None and not h.kv.host.readable(n) and h.kv.disk.readable(n) for n in path)
    return r1, path


def test_the_stage_lands_before_the_turn_and_the_turn_reloads_from_the_host_tier():
    h = DiskHarness()
    r1, path = _to_disk(h)
    end = r1.finish_time
    p = h.s.prefetcher._plans["P"]
    assert p.stage_at == pytest.approx(end + 5.0 - 0.45)  # in time for the tool's return, read by read
    assert p.at == pytest.approx(end + 5.0 - 0.05)  # then into the device, priced at the host reload
    h.idle_to(end + 4.99)
    st = h.s.stats
    assert p.staged == path and st.prefetch_staged >= 1 and h.ex.staged >= len(path)  # (the fillers' too)
    assert all(h.kv.host.readable(n) and h.kv.disk.readable(n) for n in path)
    h.idle_to(end + 5.01)
    assert [n for n, _ in p.loads] == path and st.prefetch_issued >= 1  # from the host tier, not the disk
    r2 = h.req("t2", "P", r1.token_ids + [1, 2, 3], max_tokens=2, is_last_turn=True)
    assert r2.prefetch == "used"
    h.run()
    assert r2.output_token_ids == expected(r2.prompt_token_ids, 2)
    assert (st.prefetch_stage_used, st.prefetch_used, st.preemptions) == (1, 1, 0)
    assert r2.num_cached_tokens == 20 and r2.num_loaded_tokens == 0


def test_a_turn_during_its_stage_waits_for_it_then_reloads_from_the_host_tier():
    h = DiskHarness()
    r1, path = _to_disk(h)
    p = h.s.prefetcher._plans["P"]
    h.clock.advance(p.stage_at - h.clock.now() + 1e-6)
    out = h.s.schedule()  # the stage is issued in this step's copies ...
    assert len(out.blocks_to_stage) == len(path)
    r2 = h.req("t2", "P", r1.token_ids + [1, 2, 3], max_tokens=2, is_last_turn=True)  # ... before they ran
    assert r2.prefetch == "late" and h.s.prefetcher.in_flight("P")
    h.s.update(out, h.ex.execute(out))
    h.run()
    st = h.s.stats
    assert (st.prefetch_stage_late, st.prefetch_stage_used) == (1, 0)
    assert r2.output_token_ids == expected(r2.prompt_token_ids, 2)
    assert r2.num_cached_tokens == 20 and r2.num_loaded_tokens == 20  # from the host tier it was staged into
    assert "P" not in h.s.prefetcher._plans


@pytest.mark.parametrize("how", ["end", "release"])
def test_an_ended_or_released_program_is_never_staged(how):
    h = DiskHarness()
    r1, path = _to_disk(h)
    (h.s.end_program if how == "end" else h.s.release_program)("P")
    assert h.s.prefetcher.next_due() is None
    h.idle_to(r1.finish_time + 10.0)
    assert h.s.stats.prefetch_staged == 0 and h.ex.staged == 0


def test_a_program_ended_after_its_stage_leaves_its_host_copies_first_in_line():
    h = DiskHarness()
    r1, path = _to_disk(h)
    h.idle_to(h.s.prefetcher._plans["P"].stage_at + 0.05)
    assert h.s.stats.prefetch_staged == 1 and all(h.kv.host.readable(n) for n in path)
    h.s.end_program("P")
    st = h.s.stats
    assert (st.prefetch_stage_wasted, st.prefetch_stage_wasted_blocks) == (1, len(path))
    lru = list(h.kv.host._lru)
    assert set(lru[:len(path)]) == set(path)  # the host tier's next victims
    h.req("q", "Q9", prompt_of(99, 30), max_tokens=1, is_last_turn=True)
    h.run()
    h.s.check_integrity()
