"""The disk KV tier's accounting (kv/disk_tier.py) with a fake executor that
tracks block *contents* through every tier, so a spill that lost a block or a
reload of the wrong file shows up as wrong KV, not only as broken counts."""

from __future__ import annotations

import random
from collections import deque

import pytest

from agentserve.kv.manager import KVCacheManager

BS = 4


class Tiers:
    """What an executor would hold: the content (the tokens it is the KV of) of
    every device block, host slot and disk file. With `lag` > 0 the copies land
    as an overlapping executor's do: each step's batch `lag` steps later, in the
    order taken (an offload reads its device block when taken: a snapshot).
    With `disk_lag` > 0 a batch's disk part (spills, disk reloads) lands that
    many batches after its host part, as the runner's disk link reports it: the
    spills' host slots are read (staged) when the host part runs, before its
    offloads reuse them."""

    def __init__(self, kv: KVCacheManager, lag: int = 0, disk_lag: int = 0) -> None:
        self.kv = kv
        self.lag = lag
        self.disk_lag = disk_lag
        self.dev: dict[int, tuple] = {}
        self.host: dict[int, tuple] = {}
        self.disk: dict[int, tuple] = {}
        self.flight: deque = deque()
        self.dflight: deque = deque()  # disk parts whose host part landed
        self.ticket = 0

    def step(self, fail_spills=(), fail_disk_loads=(), fail_offloads=()) -> set[int]:
        self.ticket += 1
        off, ld = self.kv.take_copies(self.ticket)
        sp, dl = self.kv.take_disk_copies(self.ticket)
        snap = [self.dev.get(b) for b, _ in off]
        self.flight.append((self.ticket, off, snap, ld, sp, dl, fail_spills, fail_disk_loads, fail_offloads))
        bad = set()
        while len(self.flight) > self.lag:
            bad |= self.land()
        return bad

    @property
    def in_flight(self) -> bool:
        return bool(self.flight or self.dflight)

    def land(self) -> set[int]:
        """The oldest batch in flight lands (with `disk_lag`: its host part, and
        the disk parts more than `disk_lag` behind; the oldest disk part when no
        host part is in flight)."""
        if not self.flight:
            return self._land_disk()
        ticket, off, snap, ld, sp, dl, fail_spills, fail_disk_loads, fail_offloads = self.flight.popleft()
        staged = [self.host[h] for h, _ in sp]  # spills first: an offload may reuse their host slots
        for i, (_, h) in enumerate(off):
            if i not in fail_offloads:
                self.host[h] = snap[i]
        for h, b in ld:
            self.dev[b] = self.host[h]
        self.dflight.append((ticket, sp, staged, dl, fail_spills, fail_disk_loads))
        if not self.disk_lag:
            return self.kv.finish_copies(fail_offloads, (), fail_spills, fail_disk_loads, ticket=ticket) \
                | self._write_disk(self.dflight.popleft())
        bad = self.kv.finish_copies(fail_offloads, (), ticket=ticket, tier="host")
        while len(self.dflight) > self.disk_lag:
            bad |= self._land_disk()
        return bad

    def _land_disk(self) -> set[int]:
        part = self.dflight.popleft()
        self._write_disk(part)
        ticket, _, _, _, fail_spills, fail_disk_loads = part
        return self.kv.finish_copies((), (), fail_spills, fail_disk_loads, ticket=ticket, tier="disk")

    def _write_disk(self, part) -> set[int]:
        _, sp, staged, dl, fail_spills, fail_disk_loads = part
        for i, (_, d) in enumerate(sp):
            if i not in fail_spills:
                self.disk[d] = staged[i]
        for i, (d, b) in enumerate(dl):
            if i not in fail_disk_loads:
                self.dev[b] = self.disk[d]
        return set()

    def run(self, tokens, now: float = 0.0, **fail) -> tuple[int, int, int]:
        """Admit, reload, compute and free `tokens` as one request; returns the
        (matched, host-reloaded, disk-reloaded) blocks; checks every reused block's content."""
        kv = self.kv
        m = kv.match(tokens)
        st = kv.admit(m, len(tokens) - m.num_tokens, now)
        assert st is not None
        bad = self.step(**fail)
        while kv.loads_pending(st):  # it waits for its own reloads, not for the batches after them
            bad |= self.land()
            kv.check_integrity([st])
        kept = kv.cut_unloaded(st, bad, now)
        done = m.num_tokens if kept is None else kept
        for i, b in enumerate(st.blocks[:done // BS]):
            assert self.dev.get(b.block_id) == tuple(tokens[i * BS:(i + 1) * BS]), "reused block holds wrong KV"
        for i in range(done // BS, len(st.blocks)):
            self.dev[st.blocks[i].block_id] = tuple(tokens[i * BS:(i + 1) * BS])
        kv.commit(st, tokens, len(tokens))
        kv.free(st, now)
        self.step()
        kv.check_integrity()
        return len(m.nodes), m.num_host_blocks - m.num_disk_blocks, m.num_disk_blocks


def seq(tag: int, blocks: int = 2) -> list[int]:
    return [tag * 1000 + i for i in range(blocks * BS)] + [0]  # + 1: a token left to compute


def mk(device=3, host=2, disk=4) -> Tiers:
    return Tiers(KVCacheManager(device, BS, host_blocks=host, disk_blocks=disk))


def test_host_eviction_spills_to_disk_and_a_disk_hit_reloads():
    t = mk()
    for tag in range(1, 4):  # each sequence evicts the last one's blocks: device -> host -> disk
        t.run(seq(tag))
    kv = t.kv
    assert kv.disk.num_used == 2 and kv.disk_copies.num_spilled == 2
    matched, from_host, from_disk = t.run(seq(1))  # the first sequence is only on disk now
    assert (matched, from_host, from_disk) == (2, 0, 2)


def test_without_a_disk_tier_host_evictions_are_dropped():
    t = mk(disk=0)
    for tag in range(1, 4):
        t.run(seq(tag))
    assert t.run(seq(1)) == (0, 0, 0)


def test_disk_tier_is_lru_within_its_budget():
    t = mk(device=3, host=2, disk=2)
    for tag in range(1, 5):
        t.run(seq(tag))
    # sequence 1 spilled first, then sequence 2 took its slots: only 2 blocks of disk
    assert t.kv.disk.num_used == 2
    assert t.run(seq(1))[2] == 0
    t2 = mk(device=3, host=2, disk=4)
    for tag in range(1, 5):
        t2.run(seq(tag))
    assert t2.run(seq(1))[2] == 2  # room for both sequences: the older one is still there


def test_a_disk_hit_moves_the_entry_to_the_recent_end():
    t = mk(device=3, host=2, disk=4)
    for tag in range(1, 4):
        t.run(seq(tag, blocks=1))  # one block each: 1 and 2 would be the oldest on disk
    for tag in range(4, 7):
        t.run(seq(tag, blocks=1))
    kv = t.kv
    order = [n.tokens[0] // 1000 for n in kv.disk._lru]
    assert order == sorted(order)
    oldest = order[0]
    n = kv.match(seq(oldest, blocks=1)).nodes[0]
    kv.disk.touch(n)
    assert [x.tokens[0] // 1000 for x in kv.disk._lru][-1] == oldest


def test_a_pending_spill_is_not_matched_and_a_failed_one_frees_its_slot():
    t = mk(device=3, host=2, disk=4)
    t.run(seq(1))
    t.run(seq(2))
    kv = t.kv
    m = kv.match(seq(3))
    st = kv.admit(m, len(seq(3)), 0.0)  # evicts sequence 1 from the host: its spills are queued
    assert len(kv.disk.pending) == 2
    assert kv.match(seq(1)).nodes == []  # not confirmed yet: not matched through the disk
    t.step(fail_spills={0, 1})
    assert kv.disk.num_used == 0 and not kv.disk.pending
    kv.free(st, 0.0)
    t.step()
    kv.check_integrity()
    assert kv.match(seq(1)).nodes == []  # nothing points at the unwritten files: pruned


def test_a_failed_disk_reload_recomputes_and_drops_the_copy():
    t = mk()
    for tag in range(1, 4):
        t.run(seq(tag))
    matched, _, from_disk = t.run(seq(1), fail_disk_loads={1})
    assert (matched, from_disk) == (2, 2)
    kv = t.kv
    assert kv.disk_copies.num_failed == 1
    # the first block reloaded; the second was recomputed (its content checked in run)
    m = kv.match(seq(1))
    assert len(m.nodes) == 2 and m.num_disk_blocks == 0


def test_check_integrity_covers_disk_slots():
    t = mk()
    for tag in range(1, 4):
        t.run(seq(tag))
    kv = t.kv
    kv.check_integrity()
    kv.disk._free.pop()  # a slot neither used nor free
    with pytest.raises(AssertionError, match="disk slots leaked"):
        kv.check_integrity()
    t2 = mk()
    for tag in range(1, 4):
        t2.run(seq(tag))
    t2.kv.disk_copies.loading.add(next(iter(t2.kv.disk._lru)))
    with pytest.raises(AssertionError, match="disk reload neither queued"):
        t2.kv.check_integrity()


@pytest.mark.parametrize("lag,disk_lag", [(0, 0), (1, 0), (3, 0), (0, 2), (1, 3)])
@pytest.mark.parametrize("seed", range(6))
def test_random_runs_keep_every_tier_consistent(seed, lag, disk_lag):
    """Many overlapping sequences, random failures of spills and disk reloads: every
    reused block holds its tokens' KV (checked in `run`), the accounting stays whole;
    also with copies landing steps after they were queued, several batches in flight,
    and with the disk link reporting batches after the host link."""
    rng = random.Random(seed)
    t = mk(device=6, host=3, disk=5)
    t.lag, t.disk_lag = lag, disk_lag
    base = {tag: [tag * 1000 + i for i in range(4 * BS)] for tag in range(1, 6)}
    disk_hits = 0
    for step in range(120):
        tag = rng.randrange(1, 6)
        n = rng.randrange(1, 4 * BS + 1)
        toks = base[tag][:n] + [rng.randrange(10**6)]
        fail = {}
        if rng.random() < 0.3:
            fail["fail_disk_loads"] = {rng.randrange(3)}
        if rng.random() < 0.3:
            fail["fail_spills"] = {rng.randrange(3)}
        if rng.random() < 0.2:
            fail["fail_offloads"] = {rng.randrange(3)}
        disk_hits += t.run(toks, now=float(step), **fail)[2]
    assert disk_hits > 0
    while t.in_flight:
        t.land()
    t.kv.check_integrity()
    assert not t.kv.copies_in_flight and not t.kv.host.pending and not t.kv.disk.pending


def test_the_spill_backlog_bound():
    from agentserve.kv.disk_tier import SPILL_STAGING_BYTES, SpillBacklog
    assert SpillBacklog(400, 1 << 21).cap == 100  # a quarter of the host tier
    assert SpillBacklog(10**7, 1 << 21).cap == SPILL_STAGING_BYTES // (1 << 21)  # within the byte budget
    b = SpillBacklog(2, 64)
    assert b.cap == 1
    assert b.fits(5)  # an empty backlog takes a batch of any size: it never waits on itself
    b.add(5)
    assert not b.fits(1) and b.peak == 5
    b.written(5)
    assert b.fits(1) and b.blocks == 0
    with pytest.raises(ValueError, match="staged"):
        b.written(1)
    with pytest.raises(ValueError, match="block_bytes"):
        SpillBacklog(4, 0)
