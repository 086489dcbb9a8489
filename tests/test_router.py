"""The router's pure logic: ReplicaLoad and its JSON, replica_load on a small
engine, route keys from chat and completions bodies (identity precedence, tenant
scoping, bad input), the program router (affinity, load escape, KV placement,
prefix affinity without an id, a dead replica, bounded memory) and the baselines."""

from __future__ import annotations

import json

import pytest
from test_scheduler import BS, FakeExecutor, Harness, prompt_of

from agentserve.clock import SimClock
from agentserve.engine.llm_engine import LLMEngine
from agentserve.engine.sampling_params import SamplingParams
from agentserve.engine.scheduler import Scheduler, SchedulerConfig
from agentserve.kv.manager import KVCacheManager
from agentserve.router.baselines import PowerOfTwoRouter, PrefixAffinityRouter, RoundRobinRouter
from agentserve.router.program_router import ProgramRouter, RouterConfig
from agentserve.router.registry import make_router, router_names
from agentserve.router.replica_load import ReplicaLoad, replica_load
from agentserve.router.route_key import CHUNK_CHARS, MAX_KEYS, RouteKey, route_key, text_prefix_keys
from agentserve.server.identity import IdentityError


def load(name: str, free: int = 100, waiting: int = 0, running: int = 0, programs=(), healthy=True,
         total: int = 100) -> ReplicaLoad:
    return ReplicaLoad(name, total, free, 0, waiting, running, frozenset(programs), healthy)


def key(pid=None, prefix=(), size=16, end=False) -> RouteKey:
    return RouteKey(pid, tuple(prefix), size, end)


def route(router, k: RouteKey, loads) -> str:
    top = router.rank(k, loads)[0][0]
    router.routed(k, top)
    return top


# ---------------------------------------------------------------- ReplicaLoad

def test_replica_load_round_trips_through_json():
    a = ReplicaLoad("r1", 100, 40, 12, 3, 5, frozenset({"t/p2", "p1"}), healthy=False, block_size=32)
    d = json.loads(json.dumps(a.to_dict()))
    assert d["programs"] == ["p1", "t/p2"]
    assert ReplicaLoad.from_dict(d) == a
    assert a.queue == 8 and a.kv_used == pytest.approx(0.6) and a.free_tokens == 1280


def test_replica_load_from_dict_fills_missing_keys_and_names_bad_types():
    assert ReplicaLoad.from_dict({"replica": "r"}) == ReplicaLoad("r", 0, 0, 0, 0, 0, frozenset())
    for bad, field in [({"replica": "r", "waiting": "3"}, "waiting"), ({"replica": "r", "free_blocks": -1}, "free"),
                       ({"replica": "r", "running": True}, "running"), ({"replica": "r", "programs": "p"}, "programs"),
                       ({"replica": "r", "programs": [1]}, "programs"), ({"replica": "r", "healthy": 1}, "healthy"),
                       ({"replica": "r", "block_size": 0}, "block_size"), ({"waiting": 1}, "replica"),
                       ({"replica": ""}, "replica")]:
        with pytest.raises(ValueError, match=field):
            ReplicaLoad.from_dict(bad)
    with pytest.raises(ValueError, match="JSON object"):
        ReplicaLoad.from_dict(["r"])


def test_replica_load_reads_an_engine():
    """Free and pinned blocks, queue and running counts and the named programs
    (pinned, or live in the program table; never an anonymous request)."""
    h = Harness("continuum", num_blocks=64, max_seqs=1, reload_cost=lambda n: 0.5 * n)
    first = h.req("a/0", "A", prompt_of(1, 20), max_tokens=2, tool_name="search", ttl_hint=30.0)
    h.run(until=lambda: first.is_finished)
    h.req("b/0", "B", prompt_of(2, 20), max_tokens=50)
    h.req("x", "x", prompt_of(3, 20), max_tokens=2, anonymous=True)
    h.step()
    got = replica_load(h.s, "r0")
    assert got.replica == "r0" and got.total_blocks == 64 and got.block_size == BS
    assert got.running == 1 and got.waiting == 1
    assert "A" in h.kv.pins and got.pinned_blocks == h.kv.num_pinned_blocks > 0
    assert got.free_blocks == h.kv.num_free_blocks
    assert got.programs == frozenset({"A", "B"})
    assert replica_load(h.s, "r0", count_pinned=False).pinned_blocks == 0
    # an LLMEngine reads the same (through its scheduler)
    clock = SimClock()
    engine = LLMEngine(Scheduler(SchedulerConfig(), KVCacheManager(16, BS), "continuum", clock),
                       FakeExecutor(clock), clock, detokenizer=lambda: _NoText())
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), program_id="t/p")
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=1))
    got = replica_load(engine, "e")
    assert got.waiting == 2 and got.programs == frozenset({"t/p"}) and got.free_blocks == 16


class _NoText:
    def push(self, token_id: int) -> str:
        return ""


# ---------------------------------------------------------------- route keys

CHAT = {"model": "m", "messages": [{"role": "system", "content": "s" * 600}, {"role": "user", "content": "hi"}]}


def test_route_key_of_a_chat_body_follows_the_identity_rules():
    assert route_key(dict(CHAT, program_id="p", user="u"), {"X-Program-Id": "h"}).program_id == "p"
    assert route_key(dict(CHAT, user="u"), {"X-Program-Id": "h"}).program_id == "h"  # any header case
    assert route_key(dict(CHAT, user="u"), {"x-session-id": "s"}).program_id == "s"
    assert route_key(dict(CHAT, user="u", agent_hints={"workflow_id": "w", "agent_id": "a"}), {}).program_id == "w/a"
    assert route_key(dict(CHAT, user="u"), {}).program_id == "u"
    assert route_key(CHAT, {}).program_id is None
    k = route_key(dict(CHAT, program_id="p", end_program=True, max_tokens=100), {}, tenant="acme")
    assert k.program_id == "acme/p" and k.end_program
    assert k.size_hint > 100 + 600 // 4


def test_prefix_keys_chain_so_a_longer_conversation_extends_them():
    one = route_key(CHAT, {})
    assert len(one.prefix_keys) == len(json.dumps(CHAT["messages"][0])) // CHUNK_CHARS >= 2
    grown = dict(CHAT, messages=CHAT["messages"] + [{"role": "assistant", "content": "a" * 900}])
    two = route_key(grown, {})
    assert two.prefix_keys[:len(one.prefix_keys)] == one.prefix_keys and len(two.prefix_keys) > len(one.prefix_keys)
    other = dict(CHAT, messages=[{"role": "system", "content": "t" + "s" * 599}] + CHAT["messages"][1:])
    assert not set(route_key(other, {}).prefix_keys) & set(one.prefix_keys)  # a chain differs from its first chunk
    # tenants and cache salts do not share keys (the engine shares no prefix blocks between them)
    assert not set(route_key(CHAT, {}, tenant="t").prefix_keys) & set(one.prefix_keys)
    assert not set(route_key(dict(CHAT, cache_salt="x"), {}).prefix_keys) & set(one.prefix_keys)
    assert len(text_prefix_keys("x" * CHUNK_CHARS * (MAX_KEYS + 5))) == MAX_KEYS


def test_route_key_ignores_a_hint_without_a_program():
    # as the server does: a request that names no program is a program of one turn, its hints moot
    assert route_key(dict(CHAT, ttl=5), {}).program_id is None


def test_route_key_of_completions_bodies():
    text = route_key({"prompt": "y" * 1000, "max_tokens": 10}, {})
    assert len(text.prefix_keys) == 3 and text.size_hint == 250 + 10
    ids = route_key({"prompt": list(range(200))}, {"X-Program-Id": "p"})
    assert ids.program_id == "p" and len(ids.prefix_keys) == 3 and ids.size_hint == 200
    batch = route_key({"prompt": ["y" * 1000, "z"]}, {})
    assert batch.prefix_keys == text.prefix_keys


@pytest.mark.parametrize("body, match", [
    ({"model": "m"}, "messages"), ({"messages": "hi"}, "messages"), ({"messages": ["hi"]}, "messages"),
    ({"prompt": 5}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [1, "a"]}, "prompt"),
    (dict(CHAT, program_id=5), "program_id"), (dict(CHAT, agent_hint={"session_id": 1}), "agent_hint.session_id"),
    (dict(CHAT, ttl="5"), "ttl"), (dict(CHAT, end_program="yes"), "end_program"),
    (dict(CHAT, max_tokens=-1), "max_tokens"), (dict(CHAT, program_id="x" * 300), "longer"),
])
def test_route_key_rejects_bad_bodies_with_a_value_error(body, match):
    with pytest.raises(ValueError, match=match):
        route_key(body, {})
    with pytest.raises(ValueError):
        route_key(["not", "a", "body"], {})


def test_bad_identity_header_is_the_identity_error():
    with pytest.raises(IdentityError):
        route_key(dict(CHAT, program_id="p"), {"X-Program-End": "maybe"})


# ---------------------------------------------------------------- the program router

def test_a_program_stays_on_its_replica():
    r = ProgramRouter()
    loads = [load("a"), load("b")]
    home = route(r, key("p"), loads)
    assert home == "a"  # a tie in load: by name
    busier = [load("a", free=60, running=3, programs={"p"}), load("b")]
    for _ in range(3):
        assert route(r, key("p"), busier) == "a"
    c = r.counters()
    assert c["placements"] == 1 and c["affinity"] == 3 and c["escapes"] == 0


def test_load_escape_moves_a_program_off_an_overloaded_replica():
    r = ProgramRouter(RouterConfig(escape_margin=4, escape_ratio=0.5))
    route(r, key("p"), [load("a"), load("b")])
    assert route(r, key("p"), [load("a", waiting=4, programs={"p"}), load("b")]) == "a"  # within the margin
    assert route(r, key("p"), [load("a", waiting=20, running=5, programs={"p"}), load("b", running=2)]) == "b"
    assert r.counters()["escapes"] == 1
    assert route(r, key("p"), [load("a", programs={"p"}), load("b", programs={"p"})]) == "b"  # its new home


def test_new_programs_are_placed_by_free_kv_and_queue():
    r = ProgramRouter()
    ranks = r.rank(key("new", size=1600), [load("a", free=20), load("b", free=90), load("c", free=90, waiting=2)])
    assert [x[0] for x in ranks] == ["b", "c", "a"]  # a full KV weighs more than two queued requests
    assert r.rank(key("x"), [load("b"), load("a")])[0] == ["a"]  # ties: by name, whatever the order given
    # a run of new programs on idle replicas whose reports have not moved yet: spread in turn
    idle = [load("b"), load("a"), load("c")]
    assert [route(r, key(f"p{i}"), idle) for i in range(6)] == ["a", "b", "c", "a", "b", "c"]
    assert route(r, key("p0"), idle) == "a"  # a returning program goes home; the round does not move
    assert route(r, key("p6"), idle) == "a"


def test_reports_correct_the_memory_and_unhealthy_replicas_are_never_ranked():
    r = ProgramRouter()
    assert route(r, key("p"), [load("a"), load("b")]) == "a"
    # another router sent p to b: the reports show it there only
    assert route(r, key("p"), [load("a"), load("b", programs={"p"})]) == "b"
    assert r.counters()["corrected"] == 1
    assert r.rank(key("p"), [load("a"), load("b", healthy=False, programs={"p"})]) == [["a"]]
    assert r.rank(key("p"), [load("b", healthy=False)]) == []
    # a router that never saw p finds it by the reports
    assert ProgramRouter().rank(key("p"), [load("a"), load("b", programs={"p"})])[0] == ["b"]


def test_id_less_requests_follow_their_prefix_chain():
    r = ProgramRouter()
    first = key(None, ("k1", "k2"))
    assert route(r, first, [load("a", free=10), load("b")]) == "b"  # placed by KV
    nxt = key(None, ("k1", "k2", "k3"))
    assert route(r, nxt, [load("a"), load("b", free=50)]) == "b"  # the conversation's replica, not the freer one
    other = key(None, ("k9",))
    assert route(r, other, [load("a"), load("b", free=50)]) == "a"
    assert r.counters()["prefix_matches"] == 1


def test_a_dead_replica_is_forgotten_and_its_programs_placed_anew():
    r = ProgramRouter()
    route(r, key("p", ("k1",)), [load("a"), load("b")])
    r.replica_gone("a")
    assert r.counters()["programs_lost"] == 1
    assert route(r, key("p"), [load("b")]) == "b"
    assert r.counters()["placements"] == 2
    assert r.prefixes.longest(("k1",), lambda _: True) == (None, 0)


def test_the_router_memory_is_bounded_and_forgets_ended_programs():
    r = ProgramRouter(RouterConfig(max_programs=10, max_prefix_keys=30))
    loads = [load("a"), load("b")]
    for i in range(100):
        route(r, key(f"p{i}", [f"k{i}-{j}" for j in range(5)]), loads)
    c = r.counters()
    assert c["programs_remembered"] == 10 and c["prefix_keys_remembered"] == 30
    route(r, key("p99", end=True), loads)
    assert r.counters()["programs_remembered"] == 9
    assert len(r._pending) == 0  # every ranked decision was settled by routed()


def test_a_request_sent_elsewhere_than_ranked_first_counts_as_a_fallback():
    r = ProgramRouter()
    k = key("p")
    assert r.rank(k, [load("a"), load("b")])[0] == ["a"]
    r.routed(k, "b")
    assert r.counters()["fallbacks"] == 1 and r.homes.peek("p") == "b"


# ---------------------------------------------------------------- baselines

def test_power_of_two_choices_is_seeded_and_picks_the_shorter_queue():
    loads = [load(n, running=i) for i, n in enumerate("abcd")]
    picks = [route(PowerOfTwoRouter(seed=1), key("p"), loads) for _ in range(3)]
    assert len(set(picks)) == 1  # the same seed, the same draw
    r = PowerOfTwoRouter(seed=0)
    for _ in range(50):
        ranks = r.rank(key(), loads)
        assert len(ranks) == 4 and ranks[0][0] != "d"  # the longest queue never wins a pair
    assert r.rank(key(), [load("a"), load("b", healthy=False)]) == [["a"]]


def test_prefix_affinity_while_balanced_else_the_shortest_queue():
    r = PrefixAffinityRouter(imbalance=4)
    assert route(r, key("ignored", ("k1", "k2")), [load("a", running=1), load("b")]) == "b"  # no match yet
    assert route(r, key("other-id", ("k1", "k2", "k3")), [load("a"), load("b", running=3)]) == "b"  # balanced
    assert route(r, key(None, ("k1", "k2", "k3")), [load("a"), load("b", running=9)]) == "a"  # imbalanced
    assert route(r, key(None, ("k1", "k2", "k3")), [load("a", running=2), load("b")]) == "a"  # its last route
    r.replica_gone("a")
    # every key went to a last, and a is forgotten: no match, the shorter queue
    assert r.rank(key(None, ("k1", "k2", "k3")), [load("a", running=1), load("b")])[0] == ["b"]
    c = r.counters()
    assert c["prefix_matches"] == 2 and c["imbalanced"] == 1


def test_round_robin_cycles_by_name_over_healthy_replicas():
    r = RoundRobinRouter()
    loads = [load("b"), load("a"), load("c", healthy=False)]
    assert [route(r, key(), loads) for _ in range(4)] == ["a", "b", "a", "b"]


def test_registry_makes_every_router():
    assert router_names() == ["program", "pow2", "prefix", "round-robin"]
    for name in router_names():
        r = make_router(name, seed=3)
        assert r.name == name and r.rank(key(), [load("a")]) == [["a"]]
    with pytest.raises(ValueError, match="unknown router"):
        make_router("random")
