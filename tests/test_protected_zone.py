"""The protected zone (kv/protected_zone.py): free blocks of multi-turn
programs between turns are evicted after every other free block, up to the
zone's capacity, and leave it when their program ends or is released."""

from __future__ import annotations

import pytest

from test_kv_manager import BS, accounting_ok, admit, compute, mk
from test_scheduler import Harness, prompt_of

from agentserve.kv.manager import KVCacheManager


def _turn(kv, rid, toks):
    admit(kv, rid, toks)
    compute(kv, rid, toks)


def test_protected_blocks_are_evicted_after_every_other_free_block():
    kv = mk(12, protected_blocks=4)
    prog = list(range(100, 116))  # 4 full blocks
    _turn(kv, "turn1", prog)
    kv.free("turn1", 1.0, protect="P")
    assert kv.num_protected_blocks == 4 and kv.num_free_blocks == 12
    accounting_ok(kv)
    # one-shot prompts come and go: newer than the program's blocks, yet evicted first
    for i in range(5):
        _turn(kv, f"one{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 4 * BS)))
        kv.free(f"one{i}", 2.0 + i)
        accounting_ok(kv)
    assert kv.match(prog + [1]).num_tokens == len(prog)
    # with no zone the same traffic pushes the program out (LRU)
    plain = mk(12)
    _turn(plain, "turn1", prog)
    plain.free("turn1", 1.0, protect="P")  # no zone: the hint changes nothing
    for i in range(5):
        _turn(plain, f"one{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 4 * BS)))
        plain.free(f"one{i}", 2.0 + i)
    assert plain.match(prog + [1]).num_tokens < len(prog)


def test_the_zone_gives_way_when_nothing_else_is_free_and_admits_only_while_it_has_room():
    kv = mk(8, protected_blocks=3)
    a, b = list(range(100, 112)), list(range(200, 212))  # 3 blocks each
    _turn(kv, "a", a)
    kv.free("a", 1.0, protect="A")
    _turn(kv, "b", b)
    kv.free("b", 2.0, protect="B")  # the zone is full: B's blocks are plain free blocks
    assert kv.num_protected_blocks == 3 and kv.pool.zone.programs() == ["A"]
    # a request needing all 8 blocks takes B's, the empty ones, then the zone's
    _turn(kv, "big", list(range(500, 532)))
    assert kv.num_protected_blocks == 0 and kv.num_free_blocks == 0
    accounting_ok(kv)
    kv.free("big", 3.0)
    accounting_ok(kv)


def test_hits_unprotect_and_demotion_take_blocks_out_of_the_zone():
    kv = mk(16, protected_blocks=8)
    p = list(range(100, 116))
    _turn(kv, "t1", p)
    kv.free("t1", 1.0, protect="P")
    assert kv.num_protected_blocks == 4
    _turn(kv, "t2", p + [7, 7, 7, 7])  # the next turn revives them by a hit
    assert kv.num_protected_blocks == 0
    accounting_ok(kv)
    kv.free("t2", 2.0, protect="P")
    assert kv.num_protected_blocks == 5
    assert kv.unprotect("P") == 5 and kv.num_protected_blocks == 0 and kv.num_free_blocks == 16
    accounting_ok(kv)
    kv.free("t2", 2.0)  # (released already: nothing)
    _turn(kv, "t3", p)
    kv.free("t3", 3.0, protect="Q")
    # the program rewrote its history: the superseded blocks go cold, zone or not
    kv.kv.supersede("Q", p, p[:4] + [9] * 12, 4.0)
    assert kv.num_protected_blocks == 1
    accounting_ok(kv)


def test_pins_that_run_out_land_in_the_zone_unless_the_program_ended():
    kv = mk(16, protected_blocks=8)
    _turn(kv, "t1", list(range(100, 116)))
    kv.pin("P", "t1", 5.0, 0.0, 1.0)
    assert kv.unpin("P", 5.0, protect=True) == 4 and kv.num_protected_blocks == 4
    _turn(kv, "t2", list(range(300, 316)))
    kv.pin("E", "t2", 5.0, 0.0, 1.0)
    kv.unpin("E", 5.0)
    assert kv.num_protected_blocks == 4
    accounting_ok(kv)


def test_the_zone_is_checked():
    with pytest.raises(ValueError, match="protected zone"):
        KVCacheManager(8, BS, protected_blocks=8)
    with pytest.raises(ValueError, match="protected zone"):
        KVCacheManager(8, BS, protected_blocks=-1)


def _between_turns(protected: int) -> tuple[int, Harness]:
    """Program P's first turn, then one-shot requests (no program id) while P
    is at its tool, then P's second turn: the prompt tokens P's second turn
    found cached. vllm-fcfs pins nothing, so only the zone keeps P's KV."""
    h = Harness("vllm-fcfs", num_blocks=24, budget=64, protected=protected)
    first = prompt_of(1, 40)
    r1 = h.req("p1", "P", first, max_tokens=4)
    h.run()
    for i in range(6):
        h.req(f"x{i}", f"anon-{i}", prompt_of(100 + i, 40), max_tokens=2, anonymous=True)
        h.run()
    r2 = h.req("p2", "P", first + r1.output_token_ids + prompt_of(2, 8), max_tokens=4, is_last_turn=True)
    h.run()
    h.s.check_integrity()
    return r2.num_cached_tokens, h


def test_a_program_between_turns_keeps_its_kv_through_one_shot_traffic():
    kept, h = _between_turns(protected=12)
    lost, _ = _between_turns(protected=0)
    assert kept >= 40 and lost == 0
    # its last turn ended the program: nothing of it stays protected
    assert h.kv.num_protected_blocks == 0


def test_release_end_and_idle_expiry_take_a_program_out_of_the_zone():
    h = Harness("vllm-fcfs", num_blocks=24, budget=64, protected=12, program_idle_timeout=10.0)
    for pid in ("R", "E", "I"):
        h.req(f"{pid}1", pid, prompt_of(ord(pid), 20), max_tokens=2)
        h.run()
    assert sorted(h.kv.pool.zone.programs()) == ["E", "I", "R"]
    assert h.s.release_program("R")
    h.s.end_program("E")
    assert h.kv.pool.zone.programs() == ["I"]
    h.clock.advance(100.0)
    h.s._expire_idle(h.clock.now())
    assert h.kv.num_protected_blocks == 0
    h.s.check_integrity()
