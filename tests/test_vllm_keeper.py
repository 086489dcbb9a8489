"""The vLLM plugin's engine-free part (integrations/vllm/keeper.py): identity from
vLLM's fields, pins held, released and reclaimed, on blocks that stand in for
vLLM's (a reference count each). The plugin inside a running vLLM is tested in
test_vllm_plugin.py."""

import pytest

from agentserve.clock import SimClock
from agentserve.integrations.vllm.keeper import ProgramKeeper, turn_identity
from agentserve.integrations.vllm.versions import version_problem

TOOL_CALL = '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'


class Block:
    def __init__(self) -> None:
        self.ref_cnt = 1


class Pool:
    """Counts what the keeper gives back, as vLLM's block pool would."""

    def __init__(self) -> None:
        self.freed: list[Block] = []

    def release(self, blocks) -> None:
        for b in blocks:
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, "a block given back twice"
        self.freed.extend(blocks)


def keeper(spec="agentserve", num_blocks=100, share=0.9):
    clock, pool = SimClock(0.0), Pool()
    k = ProgramKeeper(spec, clock, num_blocks, 16, pool.release, lambda bs: any(b.ref_cnt == 1 for b in bs),
                      max_pinned_share=share)
    return k, clock, pool


def turn_end(k, clock, request_id, session, blocks, ttl=30.0, text=TOOL_CALL, extra=None, seconds=1.0):
    """One turn of `session`, admitted and finished after `seconds`; held with `blocks` if the policy pins."""
    t = k.arrive(request_id, turn_identity(session, {"ttl": ttl, **(extra or {})}), 100)
    k.admitted(t, 0)
    clock.advance(seconds)
    held = k.finish(t, text, list(range(120)), aborted=False)
    if held > 0:
        k.hold(t, blocks, held)
    return t, held


# --- identity ---

def test_identity_reads_vllm_session_then_xargs():
    assert turn_identity("s1", None).program_id == "s1"
    assert turn_identity("s1", {"program_id": "p"}).program_id == "p"  # agentserve's own field first
    assert turn_identity(None, {"job_id": "j", "is_last_step": True}) == turn_identity(None, {"job_id": "j",
                                                                                               "end_program": True})
    assert turn_identity(None, {"job_id": 7}).program_id == "7"
    ident = turn_identity("s", {"ttl": 12, "release_program": True})
    assert (ident.ttl, ident.release_program, ident.end_program) == (12.0, True, False)


def test_identity_ignores_malformed_hints_and_hints_without_a_program():
    # vLLM's vllm_xargs turns a JSON true into 1: every spelling of a boolean is one
    assert turn_identity("s", {"end_program": 1}).end_program and turn_identity("s", {"is_last_step": "true"}).end_program
    assert not turn_identity("s", {"end_program": 0}).end_program
    ident = turn_identity("s", {"ttl": -1, "end_program": "maybe", "program_id": ""})
    assert ident.program_id == "s" and ident.ttl is None and not ident.end_program
    assert set(ident.ignored) == {"ttl", "end_program", "program_id"}
    assert turn_identity(None, {"ttl": 5, "release_program": True}) == turn_identity(None, None)
    assert turn_identity(None, {"ttl": float("inf")}).ignored == ("ttl",)


# --- pins ---

def test_a_tool_turn_is_held_and_its_next_turn_takes_it():
    k, clock, pool = keeper()
    blocks = [Block() for _ in range(6)]
    _, held = turn_end(k, clock, "r1", "s", blocks)
    assert held == 30.0 and k.pinned_blocks == 6 and not pool.freed
    nxt = k.arrive("r2", turn_identity("s", None), 140)
    assert k.priority(nxt, clock.now()) < k.priority(k.arrive("x", turn_identity("other", None), 10), clock.now())
    for b in blocks:
        b.ref_cnt += 1  # the next turn's prefix hit takes a reference
    k.admitted(nxt, 112)
    assert k.counts.pin_hits == 1 and k.pinned_blocks == 0 and pool.freed == blocks
    assert all(b.ref_cnt == 1 for b in blocks)  # the running turn's own references remain


def test_a_pin_expires_unless_its_next_turn_waits():
    k, clock, pool = keeper()
    blocks = [Block() for _ in range(4)]
    turn_end(k, clock, "r1", "s", blocks, ttl=10)
    clock.advance(11)
    k.release_due(["s"])  # the next turn waits: kept until it is admitted
    assert k.pinned_blocks == 4
    k.release_due([])
    assert k.counts.pins_expired == 1 and k.pinned_blocks == 0 and all(b.ref_cnt == 0 for b in blocks)


def test_an_ended_program_releases_at_once_and_anonymous_requests_never_pin():
    k, clock, pool = keeper()
    blocks = [Block() for _ in range(3)]
    turn_end(k, clock, "r1", "s", blocks)
    k.end_program("s")  # ended between turns
    assert k.pinned_blocks == 0 and k.counts.pins_released_at_end == 1 and all(b.ref_cnt == 0 for b in blocks)
    turn_end(k, clock, "r2", "t", [Block()])
    last, held = turn_end(k, clock, "r3", "t", [Block()], extra={"is_last_step": True})
    assert held == 0 and k.pinned_blocks == 0 and "t" not in k.programs
    _, held = turn_end(k, clock, "r3", None, [Block()])
    assert held == 0 and not k.pins


def test_release_program_records_the_tool_but_holds_nothing():
    k, clock, _ = keeper()
    t, held = turn_end(k, clock, "r1", "s", [Block()], extra={"release_program": True})
    assert held == 0 and t.tool_name == "search" and not k.pins and "s" in k.programs


def test_an_aborted_turn_is_not_held():
    k, clock, _ = keeper()
    t = k.arrive("r1", turn_identity("s", {"ttl": 30}), 100)
    k.withdrawn(t)
    assert k.finish(t, None, [], aborted=True) == 0.0 and not k.pins


def test_reclaim_takes_the_latest_program_that_frees_a_block():
    k, clock, pool = keeper()
    waiting = k.arrive("w", turn_identity("waiting", None), 50)  # its program came first
    early = [Block() for _ in range(2)]
    shared = [Block() for _ in range(2)]
    late = [Block() for _ in range(2)]
    turn_end(k, clock, "a", "early", early)
    clock.advance(1)
    turn_end(k, clock, "b", "shared", shared)
    clock.advance(1)
    turn_end(k, clock, "c", "late", late)
    for b in late:
        b.ref_cnt += 1  # another request holds these too: releasing them frees nothing
    assert k.reclaim(waiting, any_program=False)
    assert set(k.pins) == {"early", "late"} and k.counts.pins_reclaimed == 1
    own = k.arrive("e2", turn_identity("early", None), 50)  # the earliest pinned program's own turn
    assert not k.reclaim(own, any_program=False)  # no later program's pin frees anything
    assert not k.reclaim(own, any_program=True)  # and never its own
    newcomer = k.arrive("n", turn_identity("new", None), 50)
    assert not k.reclaim(newcomer, any_program=False)  # every pinned program came before it
    assert k.reclaim(newcomer, any_program=True)  # a running or late request may take any that frees
    assert set(k.pins) == {"late"}


def test_with_nothing_else_running_any_pin_goes_and_the_turns_own_last():
    """A waiting turn whose allocation fails while no other request runs: no KV comes
    back by itself, so it may take an earlier program's pin, and then its own (a turn
    that does not extend its pinned prefix would otherwise wait on it for ever)."""
    k, clock, pool = keeper()
    early = [Block() for _ in range(2)]
    own = [Block() for _ in range(3)]
    turn_end(k, clock, "a", "early", early)
    clock.advance(1)
    turn_end(k, clock, "b", "mine", own)
    nxt = k.arrive("b2", turn_identity("mine", None), 50)  # its next turn, waiting
    assert not k.make_room(nxt, any_program=False, idle=False)  # others run: it waits for their KV
    assert set(k.pins) == {"early", "mine"}
    assert k.make_room(nxt, any_program=False, idle=True)
    assert set(k.pins) == {"mine"} and all(b.ref_cnt == 0 for b in early)
    assert k.make_room(nxt, any_program=False, idle=True)
    assert not k.pins and all(b.ref_cnt == 0 for b in own) and k.counts.pins_reclaimed == 2
    assert not k.make_room(nxt, any_program=False, idle=True)  # nothing left to give


def test_pins_stay_within_their_share_of_the_pool():
    k, clock, pool = keeper(num_blocks=10, share=0.5)
    turn_end(k, clock, "a", "p1", [Block() for _ in range(4)], ttl=1e9)
    big = [Block() for _ in range(2)]
    turn_end(k, clock, "b", "p2", big, ttl=1e9)  # 6 > 5: refused, given back
    assert k.pinned_blocks == 4 and k.counts.pins_refused == 1 and all(b.ref_cnt == 0 for b in big)
    assert max(pin.expiry for pin in k.pins.values()) <= clock.now() + k.policy.max_ttl


def test_without_a_hint_the_policy_pins_a_turn_whose_miss_would_cost():
    k, clock, _ = keeper()
    for _ in range(30):
        k.observe_step(2000, 13.0, blocked=True)  # a slow prefill: 6.5 ms a token
    t = k.arrive("r1", turn_identity("s", None), 3000)
    k.admitted(t, 0)
    clock.advance(5)
    ttl = k.finish(t, "no tool here", list(range(3100)), aborted=False)
    assert ttl > 0 and t.num_computed_tokens == 3100  # a miss costs the prefill of the whole context


def test_a_policy_that_never_pins_frees_every_turn():
    k, clock, _ = keeper("vllm-fcfs")
    _, held = turn_end(k, clock, "r1", "s", [Block()])
    assert held == 0 and not k.pins


def test_the_learned_prefill_rate_sets_what_a_miss_costs():
    k, _, _ = keeper()
    before = k.prefill_seconds(1000)
    for _ in range(30):
        k.observe_step(2000, 4.0, blocked=False)  # 2 ms a token
    assert k.prefill_seconds(1000) == pytest.approx(2.0, rel=0.01) and before < 1.0
    k.observe_step(10, 100.0, blocked=True)  # a decode step says nothing of prefill
    assert k.prefill_seconds(1000) == pytest.approx(2.0, rel=0.01)


def test_bad_policy_and_share_are_refused():
    with pytest.raises(ValueError, match="unknown policy"):
        keeper("nope")
    with pytest.raises(ValueError, match="max_pinned_share"):
        keeper(share=0)


def test_version_rules():
    assert version_problem("0.32.0") is None and version_problem("0.32.3+cpu") is None
    assert "not supported" in version_problem("0.31.2") and "0.32.x" in version_problem("1.0.0")
