"""Eviction strategies: victim order on hand-made cases, plus a randomized
simulation of the block pool's calls checked against a reference model."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.kv.block import Block
from agentserve.kv.eviction import (
    ARC,
    LFU,
    LRU,
    STRATEGIES,
    EvictionStrategy,
    LeafLRU,
    make_strategy,
)

ALL = sorted(STRATEGIES)


def mk(block_id: int, parent: Block | None = None, hits: int = 0, key: int | None = None) -> Block:
    """A cached, evictable block (ref_cnt 0); links itself under `parent`."""
    b = Block(block_id)
    b.key = block_id if key is None else key
    b.tokens = (block_id,)
    b.parent = parent
    b.hits = hits
    b.ref_cnt = 0
    if parent is not None:
        parent.num_children += 1
    return b


def drain(s: EvictionStrategy) -> list[int]:
    out = []
    while len(s):
        out.append(s.pop().block_id)
    return out


# ---------------------------------------------------------------- registry


def test_registry_and_make_strategy():
    assert set(STRATEGIES) == {"lru", "leaf-lru", "lfu", "arc"}
    assert isinstance(make_strategy("lru"), LRU)
    assert isinstance(make_strategy("leaf-lru"), LeafLRU)
    assert isinstance(make_strategy("lfu"), LFU)
    arc = make_strategy("arc")
    assert isinstance(arc, ARC) and arc.capacity == 4096
    assert make_strategy("arc", capacity=16).capacity == 16
    for name in ALL:  # the pool may pass its size to any strategy
        assert make_strategy(name, capacity=8).name == name
    with pytest.raises(ValueError, match="unknown eviction strategy"):
        make_strategy("nope")


@pytest.mark.parametrize("name", ALL)
def test_empty_pop_raises(name):
    s = make_strategy(name)
    with pytest.raises(IndexError):
        s.pop()
    b = mk(1)
    s.add(b, 0.0)
    assert s.pop() is b
    with pytest.raises(IndexError):
        s.pop()


@pytest.mark.parametrize("name", ALL)
def test_len_and_contains(name):
    s = make_strategy(name)
    blocks = [mk(i) for i in range(5)]
    assert len(s) == 0 and not any(b in s for b in blocks)
    for t, b in enumerate(blocks):
        s.add(b, float(t))
    assert len(s) == 5 and all(b in s for b in blocks)
    s.remove(blocks[2])
    assert len(s) == 4 and blocks[2] not in s
    v = s.pop()
    assert v not in s and len(s) == 3
    s.add(blocks[2], 9.0)  # re-added after a revival
    assert blocks[2] in s and len(s) == 4
    assert {s.pop() for _ in range(4)} == set(blocks) - {v}
    assert len(s) == 0


# ---------------------------------------------------------------- LRU


def test_lru_order():
    s = LRU()
    a, b, c, d = (mk(i) for i in range(4))
    for t, x in enumerate((a, b, c, d)):
        s.add(x, float(t))
    s.remove(b)
    s.add(b, 10.0)  # freed again: now the most recent
    assert drain(s) == [0, 2, 3, 1]


# ---------------------------------------------------------------- leaf-lru


def test_leaf_lru_keeps_shared_parent():
    s = LeafLRU()
    root = mk(0)
    x1 = mk(1, root)
    x2 = mk(2, root)
    s.add(root, 0.0)  # freed first, but it has cached children
    s.add(x1, 1.0)
    s.add(x2, 2.0)
    assert s.pop() is x1
    root.num_children -= 1
    s.on_children_changed(root)
    assert s.pop() is x2  # root still has x2 below it
    root.num_children -= 1
    s.on_children_changed(root)  # root became a leaf
    assert s.pop() is root
    assert len(s) == 0


def test_leaf_lru_drains_a_dead_chain_before_newer_leaves():
    s = LeafLRU()
    a0 = mk(0)
    a1 = mk(1, a0)
    b0 = mk(2)
    b1 = mk(3, b0)
    for i, blk in enumerate((a0, a1, b0, b1)):  # program A freed before program B
        s.add(blk, float(i))
    assert s.pop() is a1
    a0.num_children -= 1
    s.on_children_changed(a0)  # A's head is now a leaf: it goes next, not after B's tail
    assert s.pop() is a0
    assert s.pop() is b1


def test_leaf_lru_inner_fallback_and_moves():
    s = LeafLRU()
    p1, p2 = mk(0), mk(1)
    c1 = mk(2, p1)
    c2 = mk(3, p2)  # children stay in use
    s.add(p1, 0.0)
    s.add(p2, 1.0)
    s.add(mk(4), 2.0)
    assert s.pop().block_id == 4  # the only evictable leaf
    # No evictable leaf: plain LRU among inner blocks.
    assert s.pop() is p1
    s.add(p1, 3.0)
    # A new child cached under a free leaf moves it to the inner list.
    leaf = mk(5)
    s.add(leaf, 4.0)
    mk(6, leaf)
    s.on_children_changed(leaf)
    assert [s.pop() for _ in range(3)] == [p2, p1, leaf]
    # on_children_changed of a block in use is a no-op.
    s.on_children_changed(c1)
    s.on_children_changed(c2)
    assert c1 not in s and len(s) == 0


# ---------------------------------------------------------------- lfu


def test_lfu_fewest_hits_first_ties_by_free_order():
    s = LFU()
    blocks = [mk(0, hits=3), mk(1, hits=0), mk(2, hits=5), mk(3, hits=0), mk(4, hits=1)]
    for t, b in enumerate(blocks):
        s.add(b, float(t))
    assert drain(s) == [1, 3, 4, 0, 2]


def test_lfu_stale_entries_after_remove_and_readd():
    s = LFU()
    a, b, c = mk(0, hits=0), mk(1, hits=2), mk(2, hits=1)
    for t, x in enumerate((a, b, c)):
        s.add(x, float(t))
    # A prefix hit revives `a` (removed, hit) and it is freed again later.
    s.remove(a)
    a.hits += 1
    s.on_hit(a)
    s.add(a, 5.0)
    # Its old (hits=0) entry must not be returned; c ties with a (1 hit) and was freed first.
    assert drain(s) == [2, 0, 1]
    # Many remove/re-add cycles keep the heap bounded.
    for i in range(500):
        s.add(a, float(i))
        s.remove(a)
    assert len(s._heap) <= 2 * len(s._live) + 65
    s.add(a, 0.0)
    assert s.pop() is a
    with pytest.raises(IndexError):
        s.pop()


def test_lfu_rekeys_evictable_block_on_hit():
    s = LFU()
    a, b = mk(0, hits=0), mk(1, hits=1)
    s.add(a, 0.0)
    s.add(b, 1.0)
    a.hits = 2
    s.on_hit(a)
    assert drain(s) == [1, 0]


# ---------------------------------------------------------------- arc


def test_arc_prefers_t1_by_default():
    s = ARC(capacity=8)
    hot = [mk(i, hits=2 + i) for i in range(3)]  # T2
    cold = [mk(10 + i, hits=i % 2) for i in range(3)]  # T1 (hits <= 1)
    for t, b in enumerate(hot + cold):
        s.add(b, float(t))
    assert s.p == 0
    assert drain(s) == [10, 11, 12, 0, 1, 2]  # T1 (LRU order), then T2
    assert list(s._b1) == [10, 11, 12] and list(s._b2) == [0, 1, 2]


def test_arc_adapts_p_on_ghost_hits():
    s = ARC(capacity=4)
    t1 = [mk(i, hits=0) for i in range(3)]
    t2 = [mk(10 + i, hits=2) for i in range(2)]
    for t, b in enumerate(t1 + t2):
        s.add(b, float(t))
    assert s.pop() is t1[0]  # p == 0: T1 first; key 0 -> B1
    assert s.pop() is t1[1]  # key 1 -> B1
    # Block with key 0 is needed again: T1 was evicted too eagerly.
    s.on_insert(mk(100, key=0))
    assert s.p == 1.0 and 0 not in s._b1
    # |T1| == 1 is not above p: now T2 gives the victim.
    assert s.pop() is t2[0]  # key 10 -> B2
    assert s.pop() is t2[1]  # key 11 -> B2
    s.on_insert(mk(101, key=1))  # B1 hit: p += max(1, |B2|/|B1|) = 2/1
    assert s.p == 3.0
    s.on_insert(mk(102, key=10))  # B2 hit: p -= max(1, |B1|/|B2|)
    assert s.p == 2.0
    # p never leaves [0, capacity].
    for _ in range(10):
        s._b2[999] = None
        s.on_insert(mk(103, key=999))
    assert s.p == 0.0
    for _ in range(10):
        s._b1[998] = None
        s.on_insert(mk(104, key=998))
    assert s.p == 4.0
    # Unknown keys do not move p.
    s.on_insert(mk(105, key=12345))
    assert s.p == 4.0


def test_arc_t1_victim_when_t1_exceeds_p_and_fallbacks():
    s = ARC(capacity=8)
    s.p = 1.0
    a, b = mk(0, hits=0), mk(1, hits=1)
    h = mk(2, hits=4)
    for t, x in enumerate((a, b, h)):
        s.add(x, float(t))
    assert s.pop() is a  # |T1| = 2 > p
    assert s.pop() is h  # |T1| = 1 <= p: T2
    assert s.pop() is b  # T2 empty: fall back to T1
    s.p = 0.0
    s.add(h, 5.0)
    assert s.pop() is h  # T1 empty: T2


def test_arc_ghosts_bounded_and_disjoint():
    s = ARC(capacity=3)
    for i in range(10):
        b = mk(i, hits=0)
        s.add(b, float(i))
        s.pop()
    assert list(s._b1) == [7, 8, 9]
    b = mk(50, key=8, hits=5)  # same key evicted from T2 leaves B1
    s.add(b, 0.0)
    s.pop()
    assert 8 not in s._b1 and list(s._b2) == [8]


def test_arc_promotes_evictable_block_on_hit():
    s = ARC()
    a, b = mk(0, hits=1), mk(1, hits=1)
    s.add(a, 0.0)
    s.add(b, 1.0)
    a.hits = 2
    s.on_hit(a)  # a -> T2
    assert s._t2.size == 1 and a in s
    assert drain(s) == [1, 0]


# ---------------------------------------------------------------- randomized pool simulation

N_SLOTS = 12
OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "free", "hit", "pop", "pop"]),
        st.integers(0, N_SLOTS - 1),
        st.integers(0, N_SLOTS - 1),
    ),
    min_size=20,
    max_size=200,
)


class Sim:
    """Drives a strategy the way the block pool does and checks each victim
    against a reference model of the strategy's documented order."""

    def __init__(self, name: str, n_slots: int = N_SLOTS) -> None:
        self.name = name
        self.s = make_strategy(name, capacity=6)
        self.slots: list[Block | None] = [None] * n_slots  # current block per slot
        self.free: dict[Block, int] = {}  # evictable -> order stamp
        self.freed_hits: dict[Block, int] = {}  # hits when freed (arc's T1/T2 split)
        self.popped: set[int] = set()  # id() of popped Block objects
        self.alive: list[Block] = []  # every block object ever created
        self.stamp = 0
        self.now = 0.0
        # arc reference model: ghost keys (oldest first) and the target p.
        self.cap = 6
        self.b1: list[int] = []
        self.b2: list[int] = []
        self.p = 0.0

    def _tick(self) -> int:
        self.stamp += 1
        return self.stamp

    def insert(self, i: int, j: int) -> None:
        old = self.slots[i]
        if old is not None and old.key is not None:
            return  # still cached
        parent = self.slots[j]
        if parent is None or parent.key is None or j == i:
            parent = None
        b = Block(i)
        b.key, b.tokens, b.parent, b.ref_cnt = i, (i,), parent, 1  # same key per slot: ghost hits
        self.slots[i] = b
        self.alive.append(b)
        if parent is not None:
            was_leaf = parent.num_children == 0
            parent.num_children += 1
            self.s.on_children_changed(parent)
            self._children_changed(parent, was_leaf)
        if b.key in self.b1:
            self.p = min(self.cap, self.p + max(1.0, len(self.b2) / len(self.b1)))
            self.b1.remove(b.key)
        elif b.key in self.b2:
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
            self.b2.remove(b.key)
        self.s.on_insert(b)

    def _children_changed(self, b: Block, was_leaf: bool) -> None:
        # leaf-lru moves a free block that became a leaf to the oldest end of the
        # leaves (a negative, ever smaller tick), one that became inner to the recent end.
        if self.name == "leaf-lru" and b in self.free and was_leaf != (b.num_children == 0):
            self.free[b] = -self._tick() if b.num_children == 0 else self._tick()

    def free_(self, i: int) -> None:
        b = self.slots[i]
        if b is None or b.key is None or b.ref_cnt == 0:
            return
        b.ref_cnt = 0
        self.now += 1.0
        self.s.add(b, self.now)
        self.free[b] = self._tick()
        self.freed_hits[b] = b.hits

    def hit(self, i: int) -> None:
        b = self.slots[i]
        if b is None or b.key is None:
            return
        if b.ref_cnt == 0:
            self.s.remove(b)
            del self.free[b]
        b.ref_cnt += 1
        b.hits += 1
        self.s.on_hit(b)

    def expected_victim(self) -> Block:
        free = self.free
        if self.name == "lru":
            return min(free, key=free.__getitem__)
        if self.name == "leaf-lru":
            leaves = [b for b in free if b.num_children == 0]
            return min(leaves or free, key=free.__getitem__)
        if self.name == "lfu":
            return min(free, key=lambda b: (b.hits, free[b]))
        assert self.name == "arc"
        t1 = [b for b in free if self.freed_hits[b] <= 1]
        t2 = [b for b in free if self.freed_hits[b] > 1]
        pick = t1 if t1 and (len(t1) > self.p or not t2) else t2
        return min(pick, key=free.__getitem__)

    def _ghost(self, v: Block) -> None:
        ghost, other = (self.b1, self.b2) if self.freed_hits[v] <= 1 else (self.b2, self.b1)
        for g in (ghost, other):
            if v.key in g:
                g.remove(v.key)
        ghost.append(v.key)
        del ghost[: -self.cap]

    def pop(self) -> None:
        if not self.free:
            with pytest.raises(IndexError):
                self.s.pop()
            return
        want = self.expected_victim()
        v = self.s.pop()
        assert v is want, (self.name, v, want)
        assert v.ref_cnt == 0 and v.key is not None, "popped a block in use / uncached"
        assert id(v) not in self.popped, "popped twice"
        self.popped.add(id(v))
        del self.free[v]
        self._ghost(v)
        v.key = None  # the pool drops it from the prefix index
        p = v.parent
        if p is not None and p.key is not None:
            was_leaf = p.num_children == 0
            p.num_children -= 1
            self.s.on_children_changed(p)
            self._children_changed(p, was_leaf)

    def check(self) -> None:
        assert len(self.s) == len(self.free)
        for b in self.alive:
            assert (b in self.s) == (b in self.free)
        if self.name == "arc":
            assert self.s.p == self.p and 0 <= self.p <= self.cap
            assert list(self.s._b1) == self.b1 and list(self.s._b2) == self.b2


def run_ops(name: str, ops, n_slots: int = N_SLOTS) -> Sim:
    sim = Sim(name, n_slots)
    for op, i, j in ops:
        if op == "insert":
            sim.insert(i, j)
        elif op == "free":
            sim.free_(i)
        elif op == "hit":
            sim.hit(i)
        else:
            sim.pop()
        sim.check()
    while sim.free:  # drain: everything evictable comes out exactly once
        sim.pop()
        sim.check()
    sim.pop()  # empty -> IndexError
    return sim


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=100, deadline=None)
@given(ops=OPS)
def test_randomized_pool_simulation(name, ops):
    run_ops(name, ops)


@pytest.mark.parametrize("name", ALL)
def test_long_seeded_pool_simulation(name):
    n_slots = 24
    for seed in range(4):
        rng = random.Random(seed)
        kinds = ["insert"] * 4 + ["free"] * 4 + ["hit"] * 3 + ["pop"] * 2
        ops = [(rng.choice(kinds), rng.randrange(n_slots), rng.randrange(n_slots)) for _ in range(1500)]
        sim = run_ops(name, ops, n_slots)
        assert len(sim.popped) > 100
