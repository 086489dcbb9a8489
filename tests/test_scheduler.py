"""The scheduler driven by a tiny fake executor over a real KVCacheManager.

The executor keeps a model of device and host memory: every chunk writes its
tokens into the request's block table, performs the step's offloads and loads
first, and checks that every position a chunk attends to (before `start`)
holds this request's token. So prefix hits, pins, reloads and preemption are
checked for the KV they hand out, not only for their accounting. A sampled
token is a deterministic function of the whole context, so a request's output
is fixed by its prompt: any run, preempted or not, must produce `expected()`."""

from __future__ import annotations

import random
import zlib

import pytest

from agentserve.clock import SimClock
from agentserve.engine import step_time
from agentserve.engine.executor import Executor, ExecutorResult, readable, run_copies
from agentserve.engine.request import Request, RequestStatus
from agentserve.engine.scheduler import Scheduler, SchedulerConfig
from agentserve.engine.scheduler_output import SchedulerOutput
from agentserve.engine.step_budget import StepBudget
from agentserve.engine.step_time import COLD_CHUNKS, StepTimeModel, attention_pairs, step_features
from agentserve.kv.manager import KVCacheManager
from agentserve.policy.program import ProgramState
from agentserve.policy.registry import parse_policy_spec, policy_names
from agentserve.policy.tool_stats import NO_TOOL_CALL

BS = 4
STEP = 0.01


def tok_fn(ctx) -> int:
    """The 'model': the next token given the whole context."""
    h = len(ctx)
    for t in ctx:
        h = (h * 31 + t) % 1_000_003
    return 10 + h % 50


def expected(prompt, max_tokens: int) -> list[int]:
    ctx = list(prompt)
    out = []
    for _ in range(max_tokens):
        t = tok_fn(ctx)
        out.append(t)
        ctx.append(t)
    return out


class FakeExecutor(Executor):
    def __init__(self, clock: SimClock, block_size: int = BS, step_time: float = STEP, cost=None) -> None:
        self.clock = clock
        self.bs = block_size
        self.step_time = step_time
        self.cost = cost  # SchedulerOutput -> seconds; None: every step takes `step_time`
        self.dev: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.fail_load = None  # (host slot, device block) -> whether that reload fails (leaving junk)
        self.fail_offload = None  # (device block, host slot) -> whether that offload fails

    def _offload(self, pairs):
        failed = []
        for i, (d, h) in enumerate(pairs):
            bad = self.fail_offload is not None and self.fail_offload((d, h))
            self.host[h] = ["junk"] * self.bs if bad else list(self.dev.get(d, [None] * self.bs))
            if bad:
                failed.append(i)
        return failed

    def _load(self, pairs):
        failed = []
        for i, (h, d) in enumerate(pairs):
            assert h in self.host, f"load from host slot {h} that holds nothing"
            bad = self.fail_load is not None and self.fail_load((h, d))
            self.dev[d] = ["junk"] * self.bs if bad else list(self.host[h])
            if bad:
                failed.append(i)
        return failed

    def execute(self, out: SchedulerOutput) -> ExecutorResult:
        bs = self.bs
        failed_off, failed_ld, unloaded = run_copies(out, self._offload, self._load)
        sampled = {}
        seen = set()
        for ch in readable(out.chunks, unloaded):
            req = ch.request
            rid = req.request_id
            assert rid not in seen, "a request scheduled twice in one step"
            seen.add(rid)
            assert ch.num_tokens >= 1
            assert ch.start + ch.num_tokens <= req.num_tokens
            table = req.block_table.block_ids
            assert len(table) * bs >= ch.start + ch.num_tokens, "block table too short"
            for pos in range(ch.start):
                blk = self.dev.get(table[pos // bs])
                assert blk is not None and blk[pos % bs] == req.token_ids[pos], \
                    f"{rid}: wrong KV at position {pos}"
            for pos in range(ch.start, ch.start + ch.num_tokens):
                self.dev.setdefault(table[pos // bs], [None] * bs)[pos % bs] = req.token_ids[pos]
            assert ch.sample == (ch.start + ch.num_tokens == req.num_tokens)
            if ch.sample:
                sampled[rid] = [tok_fn(req.token_ids)]
        elapsed = self.step_time if self.cost is None else self.cost(out)
        self.clock.advance(elapsed)
        return ExecutorResult(sampled, elapsed, failed_off, failed_ld)


class Harness:
    def __init__(self, policy: str = "vllm-fcfs", num_blocks: int = 64, budget: int = 32,
                 max_seqs: int = 256, host: int = 0, eviction: str = "lru",
                 reload_cost=None, step_time: float = STEP, cost=None, protected: int = 0,
                 window: int | None = None, window_pages: int = 0, **config) -> None:
        self.clock = SimClock()
        self.kv = KVCacheManager(num_blocks, BS, eviction=eviction, host_blocks=host, protected_blocks=protected,
                                 window=window, window_pages=window_pages)
        name, options = parse_policy_spec(policy)  # a spec with options, e.g. "agentserve:retire=off"
        self.s = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, **config),
                           self.kv, name, self.clock, reload_cost, policy_options=options)
        self.ex = FakeExecutor(self.clock, BS, step_time, cost)
        self.outputs: list[SchedulerOutput] = []
        self.finished: list[Request] = []
        self.admission_order: list[str] = []
        self.max_running = 0
        self.predicted: list[float | None] = []  # with `cost`: the step-time model's forecast of each step

    def req(self, rid: str, pid: str, prompt, max_tokens: int = 4, **kw) -> Request:
        r = Request(rid, pid, list(prompt), max_tokens, arrival_time=kw.pop("arrival_time", self.clock.now()), **kw)
        self.s.add_request(r)
        self.s.check_integrity()
        return r

    def step(self) -> tuple[SchedulerOutput, list[Request]]:
        before = {r.request_id for r in self.s.running}
        out = self.s.schedule()
        self.s.check_integrity()
        for ch in out.chunks:
            if ch.request.request_id not in before and ch.request.num_preemptions == 0 \
                    and ch.request.request_id not in self.admission_order:
                self.admission_order.append(ch.request.request_id)
        self.max_running = max(self.max_running, self.s.num_running)
        if self.ex.cost is not None:
            m = self.s.step_model
            self.predicted.append(m.predict(*step_features(out.chunks)[:4]) if m.ready else None)
        res = self.ex.execute(out)
        fin = self.s.update(out, res)
        self.s.check_integrity()
        self.outputs.append(out)
        self.finished.extend(fin)
        return out, fin

    def run(self, max_steps: int = 2000, until=None) -> int:
        for i in range(max_steps):
            if until is not None and until():
                return i
            if until is None and not self.s.has_work:
                return i
            self.step()
        raise AssertionError(f"no progress after {max_steps} steps: {self.s.waiting} {self.s.running}")

    def idle(self, dt: float) -> None:
        """Time passes with nothing to run; an idle loop still calls schedule()."""
        self.clock.advance(dt)
        out = self.s.schedule()
        self.s.check_integrity()
        assert not out.chunks
        if not out.is_empty:  # copies (of a pin released at expiry): the engine runs them, as a step
            self.s.update(out, self.ex.execute(out))
            self.s.check_integrity()


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 200) for _ in range(n)]


# ---------------------------------------------------------------- basics


def test_vllm_fcfs_admits_in_arrival_order():
    h = Harness("vllm-fcfs", max_seqs=1)
    h.req("c", "pc", prompt_of(3, 6), arrival_time=3.0)
    h.req("a", "pa", prompt_of(1, 6), arrival_time=1.0)
    h.req("b", "pb", prompt_of(2, 6), arrival_time=2.0)
    h.run()
    assert h.admission_order == ["a", "b", "c"]
    assert [r.request_id for r in h.finished] == ["a", "b", "c"]
    for r in h.finished:
        assert r.output_token_ids == expected(r.prompt_token_ids, 4)
        assert r.status is RequestStatus.FINISHED_LENGTH
    assert h.kv.num_free_blocks == h.kv.num_blocks


def test_chunked_prefill_then_one_token_decode():
    h = Harness(budget=8)
    r = h.req("a", "p", prompt_of(0, 30), max_tokens=5)
    sizes = []
    while not r.is_finished:
        out, _ = h.step()
        assert len(out.chunks) == 1
        ch = out.chunks[0]
        sizes.append((ch.num_tokens, ch.sample, ch.is_decode))
    assert sizes == [(8, False, False), (8, False, False), (8, False, False), (6, True, False)] + \
        [(1, True, True)] * 4
    assert r.output_token_ids == expected(r.prompt_token_ids, 5)
    assert r.num_computed_tokens == 34  # the last sampled token is never computed
    assert r.first_token_time == pytest.approx(4 * STEP)


def test_token_budget_shared_between_decode_and_prefill():
    h = Harness(budget=10)
    a = h.req("a", "pa", prompt_of(0, 5), max_tokens=20)
    h.step()  # a prefills 5
    b = h.req("b", "pb", prompt_of(1, 30), max_tokens=2)
    out, _ = h.step()
    got = {c.request.request_id: c.num_tokens for c in out.chunks}
    assert got == {"a": 1, "b": 9}  # running first, the rest of the budget for b
    assert sum(got.values()) <= 10
    h.run()
    assert a.output_token_ids == expected(a.prompt_token_ids, 20)
    assert b.output_token_ids == expected(b.prompt_token_ids, 2)


def test_max_num_seqs_caps_running():
    h = Harness(max_seqs=2)
    reqs = [h.req(f"r{i}", f"p{i}", prompt_of(i, 5), max_tokens=3) for i in range(5)]
    h.run()
    assert h.max_running == 2
    assert all(r.output_token_ids == expected(r.prompt_token_ids, 3) for r in reqs)


def test_eos_stops_a_request():
    h = Harness()
    p = prompt_of(9, 7)
    exp = expected(p, 6)
    r = h.req("a", "p", p, max_tokens=6, eos_token_ids=frozenset({exp[2]}))
    h.run()
    assert r.output_token_ids == exp[:exp.index(exp[2]) + 1]
    assert r.status is RequestStatus.FINISHED_STOPPED


def test_add_request_rejections():
    h = Harness(num_blocks=8)
    with pytest.raises(ValueError):
        h.req("big", "p", prompt_of(0, 30), max_tokens=3)  # 33 tokens > 8 blocks of 4
    h.req("ok", "p", prompt_of(0, 29), max_tokens=3)  # exactly 8 blocks
    with pytest.raises(ValueError):
        h.req("ok", "q", prompt_of(1, 4))
    assert h.s.num_waiting == 1
    h.run()
    assert h.finished[0].request_id == "ok"
    h.req("ok", "p", prompt_of(1, 4))  # a finished id may be reused
    h.run()


def test_abort_waiting_and_running():
    h = Harness(num_blocks=16, max_seqs=2)
    a = h.req("a", "pa", prompt_of(0, 10), max_tokens=30)
    b = h.req("b", "pb", prompt_of(1, 10), max_tokens=30)
    c = h.req("c", "pc", prompt_of(2, 10), max_tokens=5)
    w = h.req("w", "pw", prompt_of(3, 10), max_tokens=5)
    for _ in range(3):
        h.step()
    assert {r.request_id for r in h.s.running} == {"a", "b"}
    assert h.s.abort("c") is c
    assert c.status is RequestStatus.FINISHED_ABORTED
    h.s.check_integrity()
    free_before = h.kv.num_free_blocks
    assert h.s.abort("a") is a
    h.s.check_integrity()
    assert h.kv.num_free_blocks > free_before
    assert a.block_table is None
    assert h.s.abort("a") is None
    assert h.s.abort("nope") is None
    h.run()
    assert b.output_token_ids == expected(b.prompt_token_ids, 30)
    assert w.output_token_ids == expected(w.prompt_token_ids, 5)
    assert "a" not in [r.request_id for r in h.finished] and "c" not in [r.request_id for r in h.finished]
    assert h.kv.num_free_blocks == h.kv.num_blocks


def test_abort_during_a_step_skips_its_chunk():
    h = Harness()
    a = h.req("a", "pa", prompt_of(0, 6), max_tokens=5)
    b = h.req("b", "pb", prompt_of(1, 6), max_tokens=5)
    out = h.s.schedule()
    res = h.ex.execute(out)
    h.s.abort("a")
    fin = h.s.update(out, res)
    h.s.check_integrity()
    assert fin == [] and a.output_token_ids == []
    h.run()
    assert b.output_token_ids == expected(b.prompt_token_ids, 5)
    assert h.kv.num_free_blocks == h.kv.num_blocks


def test_max_model_len_and_finish_request():
    clock = SimClock()
    kv = KVCacheManager(32, BS)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=12), kv, "vllm-fcfs", clock)
    ex = FakeExecutor(clock)
    with pytest.raises(ValueError):
        s.add_request(Request("long", "p", prompt_of(0, 12), 3, arrival_time=0.0))
    r = Request("r", "p", prompt_of(0, 8), 10, arrival_time=0.0)
    q = Request("q", "q", prompt_of(1, 5), 10, arrival_time=0.0)
    s.add_request(r)
    s.add_request(q)
    for _ in range(20):
        if not s.has_work:
            break
        out = s.schedule()
        fin = s.update(out, ex.execute(out))
        s.check_integrity()
        if q.num_output_tokens == 2 and q.status is RequestStatus.RUNNING:
            s.finish_request("q")
            s.check_integrity()
    assert r.num_tokens == 12 and r.status is RequestStatus.FINISHED_LENGTH
    assert r.output_token_ids == expected(r.prompt_token_ids, 4)
    assert q.status is RequestStatus.FINISHED_STOPPED and q.num_output_tokens == 2
    assert kv.num_free_blocks == kv.num_blocks
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError):
        Request("x", "p", [], 1, arrival_time=0.0)
    with pytest.raises(ValueError):
        Request("x", "p", [1], 0, arrival_time=0.0)


def test_idle_programs_are_forgotten_but_pinned_ones_kept():
    clock = SimClock()
    kv = KVCacheManager(32, BS)
    s = Scheduler(SchedulerConfig(program_idle_timeout=10.0), kv, "continuum", clock)
    ex = FakeExecutor(clock)
    s.add_request(Request("a", "A", prompt_of(0, 9), 2, arrival_time=0.0))
    s.add_request(Request("b", "B", prompt_of(1, 9), 2, arrival_time=0.0, ttl_hint=1e6))
    while s.has_work:
        out = s.schedule()
        s.update(out, ex.execute(out))
        s.check_integrity()
    assert "B" in kv.pins and "A" in s.programs
    clock.advance(100.0)
    while s.stats.steps % 1024:
        s.schedule()
    s.schedule()
    s.check_integrity()
    assert "A" not in s.programs and "B" in s.programs


# ---------------------------------------------------------------- decodes first, step-time target


def linear_cost(out: SchedulerOutput) -> float:
    """A made-up machine whose step time has the step-time model's form: 2 ms a
    step, 20 us a prompt token, 1 us per query-key pair, 0.2 ms a decode row,
    1 us per context token a decode reads."""
    p, a, d, k, _, _ = step_features(out.chunks)
    assert out.features is None or out.features[:4] == (p, a, d, k)  # the scheduler's own gathering agrees
    return 0.002 + 2e-5 * p + 1e-6 * a + 2e-4 * d + 1e-6 * k


TARGET_MS = 10.0


def _timed(num_blocks: int = 256, budget: int = 64, **config) -> Harness:
    config.setdefault("max_step_ms_with_decodes", TARGET_MS)
    config.setdefault("min_prefill_chunk", 4)
    return Harness(num_blocks=num_blocks, budget=budget, cost=linear_cost, **config)


def _warm_up(h: Harness) -> None:
    """Requests of several sizes, one at a time: the model sees prefill and decode steps."""
    for i, n in enumerate((5, 30, 60, 12, 45, 100)):
        h.req(f"w{i}", f"pw{i}", prompt_of(50 + i, n), max_tokens=3)
        h.run()
    assert h.s.step_model.ready or not h.s.config.max_step_ms_with_decodes  # no target: nothing learned
    assert h.s.stats.capped_steps == 0


def _prefills(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks if not c.is_decode]


def _long_prompt_beside_a_decode(h: Harness, prompt_len: int = 400):
    """x decodes; P (a long prompt) arrives, then D (a short one) just after."""
    _warm_up(h)
    x = h.req("x", "px", prompt_of(60, 6), max_tokens=100)
    h.step()
    p = h.req("P", "pP", prompt_of(7, prompt_len), max_tokens=2)
    h.clock.advance(0.001)
    d = h.req("D", "pD", prompt_of(8, 3), max_tokens=40)
    return x, p, d


def _linear_machine_samples(m: StepTimeModel, n: int, slow: float = 1.0, seed: int = 0) -> tuple:
    rng = random.Random(seed)
    true = (0.002, 2e-5, 1e-6, 2e-4, 1e-6)
    for _ in range(n):
        d = rng.randrange(0, 8)
        k = d * rng.randrange(10, 400)
        p = rng.choice([0, 0, 16, 64, 200]) if d else rng.choice([16, 64, 200])
        a = attention_pairs(rng.randrange(0, 500), p) if p else 0
        m.observe(p, a, d, k, slow * (true[0] + true[1] * p + true[2] * a + true[3] * d + true[4] * k))
    return true


def test_step_time_model_recovers_a_linear_machine():
    m = StepTimeModel()
    assert not m.ready and m.coefficients == (0.0,) * 5
    true = _linear_machine_samples(m, 60)
    assert m.ready
    assert m.coefficients == pytest.approx(true, rel=1e-3)
    # the longest chunk that fits a time is the inverse of chunk_time
    for start, seconds in [(0, 0.01), (300, 0.005), (5000, 0.02), (10, 1e-9)]:
        n = m.max_chunk(start, seconds)
        assert m.chunk_time(start, n) <= seconds < m.chunk_time(start, n + 1)
    assert m.max_chunk(0, 0.0) == 0


def test_step_time_model_keeps_coefficients_non_negative():
    m = StepTimeModel(min_samples=2, min_prefill_samples=2)
    # bigger chunks measured faster (noise): no negative price for a prompt token
    for p, t in [(10, 0.02), (100, 0.015), (50, 0.017), (200, 0.012)]:
        m.observe(p, attention_pairs(0, p), 0, 0, t)
    m.observe(0, 0, 1, 5, -1.0)  # not a time: ignored
    m.observe(0, 0, 0, 0, 0.01)  # an empty step: ignored
    assert m.num_samples == 4 and m.ready
    a, b, c, d, e = m.coefficients
    assert a == pytest.approx(0.016, rel=1e-3) and b == c == d == e == 0.0  # the mean, no negative slope
    assert m.max_chunk(0, 0.001) >= 1 << 20  # prompt tokens priced at 0: any chunk fits


def test_step_time_model_forgets_a_spike_but_follows_a_slower_machine():
    m = StepTimeModel()
    m.observe(5, attention_pairs(0, 5), 0, 0, 5.0)  # the first step compiled a kernel
    true = _linear_machine_samples(m, 40)
    assert m.num_samples == 40  # the spike is gone
    assert m.coefficients == pytest.approx(true, rel=1e-3)
    # the machine gets 4x slower for good: the fit follows once the window has turned over
    _linear_machine_samples(m, 200, slow=4.0, seed=1)
    assert m.coefficients == pytest.approx([4 * c for c in true], rel=1e-3)


def _plan_to_a_target(seed: int) -> tuple[StepTimeModel, float]:
    """Steps of 8 decodes and a chunk planned to 200 ms on a linear machine whose
    times scatter +-20%: (the model, the share of steps that overran)."""
    rng = random.Random(seed)
    m = StepTimeModel()
    true = (0.004, 2e-4, 1e-8, 1e-3, 2e-6)
    cost = lambda p, a, d, k: true[0] + true[1] * p + true[2] * a + true[3] * d + true[4] * k  # noqa: E731
    target, over, steps = 0.2, 0, 0
    for i in range(600):
        d, k = 8, 8 * rng.randrange(1000, 4000)
        start = rng.randrange(0, 4000)
        n = m.max_chunk(start, target - m.base_time(d, k)) if m.ready else rng.choice([64, 256, 512])
        if n <= 0:
            continue
        a = attention_pairs(start, n)
        taken = cost(n, a, d, k) * rng.uniform(0.8, 1.2)
        m.observe(n, a, d, k, taken)
        if i >= 100:  # once the fit and the margin have samples
            steps += 1
            over += taken > target
    return m, over / steps


def test_step_time_margin_keeps_most_steps_under_the_target(monkeypatch):
    """With the margin (a high quantile of taken/predicted) nearly all steps stay
    under the target; planned with the fit alone, about half overrun it."""
    m, over = _plan_to_a_target(3)
    assert 1.1 < m.margin < 1.3
    assert over <= 0.05  # the 0.97 quantile: about 3 steps in 100 over the target
    assert m.predict(100, attention_pairs(0, 100), 1, 10) == pytest.approx(m.base_time(1, 10) + m.chunk_time(0, 100))
    monkeypatch.setattr(step_time, "MARGIN_QUANTILE", 0.5)
    m, over = _plan_to_a_target(3)
    assert m.margin < 1.05 and over > 0.3


def test_decodes_go_before_the_prefill_of_an_earlier_admitted_request():
    """P (admitted first) is still prefilling when D, admitted after it, decodes:
    every step gives x and D their token before P's chunk, and under a budget
    that P alone could fill, the decodes still get theirs."""
    h = _timed()
    x, p, d = _long_prompt_beside_a_decode(h)
    while d.num_output_tokens == 0:
        h.step()
    assert p.status is RequestStatus.RUNNING and p.num_computed_tokens < p.num_prompt_tokens
    assert h.admission_order.index("P") < h.admission_order.index("D")
    for _ in range(3):
        out, _ = h.step()
        kinds = [c.is_decode for c in out.chunks]
        assert kinds == sorted(kinds, reverse=True), "a prefill chunk went before a decode"
        assert {c.request.request_id for c in out.chunks if c.is_decode} == {"x", "D"}
        assert [rid for rid, _, _ in _prefills(out)] == ["P"]
    assert p.num_tokens - p.num_computed_tokens > 8
    # no cap, a budget P could fill on its own: the decodes still go first
    h.s.config.max_step_ms_with_decodes = None
    h.s.config.max_num_batched_tokens = 8
    start = p.num_computed_tokens
    out, _ = h.step()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("x", 1), ("D", 1), ("P", 6)]
    assert out.chunks[2].start == start
    h.run()
    for r in (x, p, d):
        assert r.output_token_ids == expected(r.prompt_token_ids, r.max_tokens)
    assert h.kv.num_free_blocks == h.kv.num_blocks


def test_prefill_that_needs_blocks_preempts_a_later_decode_already_scheduled():
    """Victims are chosen as before decodes went first: among the requests
    admitted at or after the one that needs a block. D decodes before P's chunk
    but was admitted after P, so when P's chunk does not fit, D gives its token
    back and is preempted; x, admitted before P, keeps decoding."""
    h = _timed(num_blocks=108)
    x, p, d = _long_prompt_beside_a_decode(h)
    hit = None
    while not p.is_finished:
        decoding_before = d.status is RequestStatus.RUNNING and d.num_output_tokens > 0
        out, _ = h.step()  # check_integrity after schedule() and after update()
        if out.preempted and hit is None:
            hit = out
            assert out.preempted == [d] and decoding_before
            assert [c.request.request_id for c in out.chunks] == ["x", "P"]
            assert d.num_computed_tokens == 0 and d.block_table is None
    assert hit is not None
    h.run()
    for r in (x, p, d):
        assert r.output_token_ids == expected(r.prompt_token_ids, r.max_tokens)
    assert h.kv.num_free_blocks == h.kv.num_blocks


def test_prefill_beside_drafting_streams_gets_the_time_their_drafts_earn():
    """The target is per token of the least-served decoding stream: where every
    stream's draft is expected to give it 3 tokens, the step may take 3 targets,
    and a prefill chunk the time the decodes leave of that."""
    h = _timed()
    _warm_up(h)
    step = StepBudget(64, h.s.step_model, 4)
    step.decode_rows, step.decode_context = 2, 100
    plain = step.prefill_time_left(TARGET_MS)
    step.per_token = 3.0
    assert step.prefill_time_left(TARGET_MS) == pytest.approx(plain + 2 * TARGET_MS / 1000)
    assert StepBudget(64, h.s.step_model, 4).prefill_time_left(TARGET_MS) is None  # no decode: no cap


def test_long_prompt_beside_decodes_is_chunked_under_the_step_time_target():
    h = _timed()
    x, p, d = _long_prompt_beside_a_decode(h)
    first = len(h.outputs)
    x_tokens = x.num_output_tokens
    while not p.is_finished:
        h.step()
    target = TARGET_MS / 1000
    sizes = []
    for out, pred, t in zip(h.outputs[first:], h.predicted[first:], [linear_cost(o) for o in h.outputs[first:]]):
        chunk = [n for rid, _, n in _prefills(out) if rid == "P"]
        sizes += chunk
        assert any(c.is_decode for c in out.chunks)
        if pred is not None and out.num_prefill_tokens > h.s.config.min_prefill_chunk:
            assert pred <= target + 1e-9
            assert t <= target * 1.02  # the fake machine is what the model fits
    # the prompt went in chunks well under the budget, and x decoded all along
    assert sum(sizes) == p.num_prompt_tokens
    assert len(sizes) >= 10 and max(sizes[3:]) < 40
    assert x.num_output_tokens - x_tokens == len(h.outputs) - first
    assert h.s.stats.capped_steps >= 8
    st = h.s.stats
    assert st.decode_steps >= len(h.outputs) - first
    assert st.decode_step_max_s == max(st.decode_step_history)
    assert target * 0.9 < st.decode_step_p99_s() <= st.decode_step_max_s
    h.run()
    for r in (x, p, d):
        assert r.output_token_ids == expected(r.prompt_token_ids, r.max_tokens)
    # the same arrivals without a target: P takes the budget, steps with x decoding run long
    u = _timed(max_step_ms_with_decodes=None)
    x2, p2, _ = _long_prompt_beside_a_decode(u)
    u.run()
    assert u.s.stats.capped_steps == 0
    assert u.s.stats.decode_step_max_s > 2 * target
    assert p2.output_token_ids == p.output_token_ids


def test_without_decodes_the_whole_budget_is_used():
    h = _timed()
    _warm_up(h)
    p = h.req("P", "pP", prompt_of(7, 400), max_tokens=3)
    sizes = []
    while p.num_output_tokens == 0:
        out, _ = h.step()
        sizes.append(out.num_prefill_tokens)
    assert sizes == [64] * 6 + [16]
    assert max(linear_cost(o) for o in h.outputs[-7:]) > 2 * TARGET_MS / 1000  # long steps, nobody waiting
    assert h.s.stats.capped_steps == 0
    h.run()
    assert p.output_token_ids == expected(p.prompt_token_ids, 3)


@pytest.mark.parametrize("target", [None, 0.0])
def test_no_target_no_cap(target):
    h = _timed(max_step_ms_with_decodes=target)
    x, p, _ = _long_prompt_beside_a_decode(h)
    out, _ = h.step()
    assert _prefills(out) == [("P", 0, 63)]
    h.run()
    assert h.s.stats.capped_steps == 0


def test_a_few_smallest_chunks_beside_decodes_until_the_model_has_samples():
    """Before the step-time model can price a chunk, a step with decodes takes
    COLD_CHUNKS smallest chunks of prefill, not the whole token budget (a
    512-token chunk at first use held a decode for half a second)."""
    h = _timed()
    x = h.req("x", "px", prompt_of(60, 6), max_tokens=100)
    h.step()
    p = h.req("P", "pP", prompt_of(7, 800), max_tokens=2)
    sizes = []
    while not h.s.step_model.ready:
        out, _ = h.step()
        sizes += [n for _, _, n in _prefills(out)]
    assert sizes == [COLD_CHUNKS * 4] * len(sizes) and len(sizes) >= 3  # min_prefill_chunk 4
    h.run()
    assert h.s.stats.capped_steps > 0  # once it had learned
    assert p.output_token_ids == expected(p.prompt_token_ids, 2)


def test_prefill_progresses_when_decodes_alone_exceed_the_target():
    h = _timed(max_step_ms_with_decodes=1.0, min_prefill_chunk=5)  # every step costs 2 ms
    _warm_up(h)
    x = h.req("x", "px", prompt_of(60, 6), max_tokens=200)
    h.step()
    p = h.req("P", "pP", prompt_of(7, 100), max_tokens=2)
    sizes = []
    while p.num_output_tokens == 0:
        out, _ = h.step()
        sizes += [n for rid, _, n in _prefills(out) if rid == "P"]
    assert sizes == [5] * 20
    h.run()
    assert p.output_token_ids == expected(p.prompt_token_ids, 2)


def test_step_time_config_is_checked():
    with pytest.raises(ValueError):
        SchedulerConfig(max_step_ms_with_decodes=-1.0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_step_ms_with_decodes=float("nan"))
    with pytest.raises(ValueError):
        SchedulerConfig(min_prefill_chunk=0)
    assert SchedulerConfig().max_step_ms_with_decodes == 200.0


# ---------------------------------------------------------------- preemption


def _preemption_workload(h: Harness):
    return [h.req(f"r{i}", f"p{i}", prompt_of(10 + i, 9), max_tokens=24, arrival_time=float(i))
            for i in range(3)]


@pytest.mark.parametrize("policy", ["vllm-fcfs", "program-fcfs", "autellix", "infercept"])
def test_preemption_by_recompute(policy):
    ref = Harness(policy, num_blocks=64)
    ref_reqs = _preemption_workload(ref)
    ref.run()
    assert ref.s.stats.preemptions == 0

    # 3 requests of 33 tokens need 27 blocks at the end; 16 do not hold them
    h = Harness(policy, num_blocks=16)
    reqs = _preemption_workload(h)
    first_victim = None
    for _ in range(2000):
        if not h.s.has_work:
            break
        out, _ = h.step()
        if out.preempted and first_victim is None:
            first_victim = out.preempted[0]
            # the latest-arriving (lowest-priority) running request went first
            assert first_victim.request_id == "r2"
            assert first_victim.status is RequestStatus.WAITING and first_victim.preempted
            assert first_victim.num_computed_tokens == 0
            assert first_victim.block_table is None
    assert not h.s.has_work
    assert first_victim is not None
    assert h.s.stats.preemptions >= 1
    assert h.s.stats.preemptions == sum(r.num_preemptions for r in reqs)
    for r, rr in zip(reqs, ref_reqs):
        assert r.output_token_ids == rr.output_token_ids == expected(r.prompt_token_ids, 24)
        assert r.is_finished and not r.preempted
    assert h.kv.num_free_blocks == h.kv.num_blocks


def test_continuum_headroom_admits_whole_requests_instead_of_preempting():
    # the workload above: with chunk-level admission all three start and preempt each
    # other; continuum admits a request only when its whole prompt and output fit
    h = Harness("continuum", num_blocks=16)
    reqs = _preemption_workload(h)
    h.run()
    assert h.s.stats.preemptions == 0
    assert h.max_running == 1  # 9 blocks each: a second never fits beside the first's reserve
    assert [r.request_id for r in h.finished] == ["r0", "r1", "r2"]
    for r in reqs:
        assert r.output_token_ids == expected(r.prompt_token_ids, 24)
    assert h.kv.num_free_blocks == h.kv.num_blocks


def test_headroom_counts_running_requests_remaining_output():
    # 32 blocks; a runs with 9 prompt tokens and 24 to generate (9 blocks at the end).
    h = Harness("continuum", num_blocks=32, budget=64)
    a = h.req("a", "pa", prompt_of(1, 9), max_tokens=24)
    h.step()
    assert len(a.block_table) == 3
    # b needs 9 + 2 = 11 tokens: 3 blocks; free 29 - a's 6 still to come = 23: admitted
    b = h.req("b", "pb", prompt_of(2, 9), max_tokens=2)
    # c needs (60 + 24) / 4 = 21 blocks: 23 - b's 3 = 20 left, so c waits for b
    c = h.req("c", "pc", prompt_of(3, 60), max_tokens=24)
    h.step()
    assert b.status is RequestStatus.RUNNING and c.status is RequestStatus.WAITING
    h.run(until=lambda: b.is_finished)
    h.step()
    assert c.status is RequestStatus.RUNNING
    h.run()
    assert h.s.stats.preemptions == 0
    assert all(r.output_token_ids == expected(r.prompt_token_ids, r.max_tokens) for r in (a, b, c))


def test_headroom_never_blocks_a_request_when_nothing_runs():
    # a pin of a later program fills the rest; a request that needs the whole cache still runs
    h = Harness("continuum", num_blocks=8, budget=8, reload_cost=reload_cost)
    _turn1(h, pid="LATE", n=9, max_tokens=2, arrival_time=5.0)
    assert "LATE" in h.kv.pins
    r = h.req("big", "EARLY", prompt_of(5, 20), max_tokens=12, arrival_time=0.0)
    h.run(until=lambda: r.is_finished)
    assert r.output_token_ids == expected(r.prompt_token_ids, 12)
    assert h.s.stats.pins_reclaimed == 1


def test_preempted_request_goes_first_when_readmitted():
    h = Harness("vllm-fcfs", num_blocks=16)
    reqs = _preemption_workload(h)
    h.run(until=lambda: h.s.stats.preemptions > 0)
    late = h.req("late", "pl", prompt_of(99, 5), max_tokens=2, arrival_time=-1.0)  # 'earliest' arrival
    victim = next(r for r in reqs if r.preempted)
    key_victim = h.s._key(victim, h.clock.now())
    key_late = h.s._key(late, h.clock.now())
    assert key_victim < key_late
    h.run()
    for r in reqs:
        assert r.output_token_ids == expected(r.prompt_token_ids, 24)


def test_preemption_with_host_tier_and_swap_policy():
    """A policy that swaps on preemption (the host tier keeps the victim's KV):
    the victim reloads instead of recomputing, and outputs still match."""
    h = Harness("vllm-fcfs", num_blocks=16, host=32)
    h.s.policy.swap_on_preempt = lambda req: True
    reqs = _preemption_workload(h)
    h.run()
    assert h.s.stats.preemptions >= 1
    assert any(o.blocks_to_offload for o in h.outputs)
    for r in reqs:
        assert r.output_token_ids == expected(r.prompt_token_ids, 24)
    assert h.kv.num_free_blocks == h.kv.num_blocks


def test_host_tier_reload_counts_loaded_tokens():
    """A turn's KV evicted to the host comes back by reload: the hit counts as
    cached and as loaded (this used to read 0 loaded tokens, measured after
    admit had already given the host nodes device blocks)."""
    h = Harness("vllm-fcfs", num_blocks=8, host=16)
    r1 = h.req("t1", "P", prompt_of(1, 18), max_tokens=5)
    h.run()
    filler = h.req("f", "Q", prompt_of(2, 30), max_tokens=1)  # 8 blocks: evicts all of t1's
    h.run()
    assert sum(len(o.blocks_to_offload) for o in h.outputs) >= 5
    r2 = h.req("t2", "P", r1.token_ids + [1, 2, 3], max_tokens=2)
    out, _ = h.step()
    assert len(out.blocks_to_load) == 5
    assert r2.num_cached_tokens == 20 and r2.num_loaded_tokens == 20
    assert h.s.stats.loaded_tokens == 20 and h.s.stats.hit_tokens == 20
    assert [d for _, d in out.blocks_to_load] == r2.block_table.block_ids[:5]
    h.run()
    assert r2.output_token_ids == expected(r2.prompt_token_ids, 2)
    assert filler.output_token_ids == expected(filler.prompt_token_ids, 1)


@pytest.mark.parametrize("seed", range(4))
def test_failed_copies_never_hand_out_unwritten_kv(seed):
    """The executor fails some offloads and reloads, leaving junk where they
    were to write: the requests that wanted a failed reload recompute (the
    fake executor checks every position a chunk reads), the outputs are the
    expected ones, and nothing leaks."""
    rng = random.Random(seed)
    h = Harness("vllm-fcfs", num_blocks=12, host=24, budget=16)
    h.ex.fail_load = lambda pair: rng.random() < 0.4
    h.ex.fail_offload = lambda pair: rng.random() < 0.2
    reqs = []
    for turn in range(4):
        for p in range(3):
            prev = next((r for r in reversed(reqs) if r.program_id == f"P{p}"), None)
            prompt = (prev.token_ids if prev else prompt_of(p, 9)) + prompt_of(100 * turn + p, 3)
            reqs.append(h.req(f"r{turn}{p}", f"P{p}", prompt, max_tokens=3))
            h.run()
    assert h.s.stats.reload_failed_blocks > 0 and h.s.stats.loaded_tokens > 0
    for r in reqs:
        assert r.output_token_ids == expected(r.prompt_token_ids, 3)
    assert h.kv.num_free_blocks == h.kv.num_blocks
    assert not h.kv.host.pending


def test_a_step_that_raises_confirms_none_of_its_copies():
    """The executor raises in a step that carries reloads (the server then fails
    that step's requests): none of its copies count, the KV stays consistent and
    the engine runs on (it used to be refused: the copies were never finished)."""
    from agentserve.engine.llm_engine import LLMEngine
    from agentserve.engine.sampling_params import SamplingParams

    class _NoText:
        def push(self, token_id: int) -> str:
            return ""

    h = Harness("vllm-fcfs", num_blocks=8, host=16)
    engine = LLMEngine(h.s, h.ex, h.clock, detokenizer=lambda: _NoText())
    first = engine.add_request(prompt_of(1, 18), SamplingParams(max_tokens=5), program_id="P")
    while engine.num_unfinished:
        engine.step()
    engine.add_request(prompt_of(2, 30), SamplingParams(max_tokens=1), program_id="Q")  # evicts P's blocks
    while engine.num_unfinished:
        engine.step()
    turn2 = engine.add_request(first.token_ids + [1, 2, 3], SamplingParams(max_tokens=2), program_id="P")
    real = h.ex.execute

    def crash(out):
        assert out.blocks_to_load  # the step that reloads P's prefix
        raise RuntimeError("device lost")

    h.ex.execute = crash
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert h.kv.host.num_used == 0  # the reloads failed: their host copies are not trusted
    h.s.abort(turn2.request_id)  # as the server does with a failed step's requests
    h.s.check_integrity()
    h.ex.execute = real
    again = engine.add_request(turn2.prompt_token_ids, SamplingParams(max_tokens=2), program_id="P")
    while engine.num_unfinished:
        engine.step()
    assert again.output_token_ids == expected(again.prompt_token_ids, 2)
    assert h.kv.num_free_blocks == h.kv.num_blocks


# ---------------------------------------------------------------- continuum pins


def reload_cost(n: int) -> float:
    return 0.5 * n  # expensive rebuilds: the cold-start TTL is long enough to pin


def _turn1(h: Harness, pid: str = "P", rid: str = "t1", n: int = 18, max_tokens: int = 5, **kw):
    # a stable seed per program (str hash() changes between processes and once made prompts collide)
    r = h.req(rid, pid, prompt_of(10_000 + zlib.crc32(pid.encode()) % 100_000, n), max_tokens=max_tokens,
              tool_name="search", **kw)
    h.run(until=lambda: r.is_finished)
    return r


def test_continuum_pins_tool_turn_and_next_turn_hits():
    h = Harness("continuum", reload_cost=reload_cost)
    r1 = _turn1(h)
    assert "P" in h.kv.pins
    pin = h.kv.pins["P"]
    assert pin.expiry > h.clock.now()
    assert h.s.stats.pins_created == 1
    computed = r1.num_computed_tokens
    assert computed == r1.num_tokens - 1
    h.idle(0.2)  # the tool runs (well within the TTL)
    assert "P" in h.kv.pins
    prompt2 = r1.token_ids + [7, 8, 9, 10, 11]
    r2 = h.req("t2", "P", prompt2, max_tokens=3)
    h.step()
    assert r2.num_cached_tokens == (computed // BS) * BS == 20
    assert h.s.stats.pins_hit == 1
    assert "P" not in h.kv.pins  # the pin is released on admission
    h.run()
    assert r2.output_token_ids == expected(prompt2, 3)
    # the tool's duration was learned from finish -> next arrival
    assert h.s.policy.tool_stats.count("search") == 1
    # a turn without a tool call is pinned too (the program did not end): its gap is
    # learned apart from the tools' and does not enter the global window
    assert "P" in h.kv.pins
    h.idle(0.5)
    r3 = h.req("t3", "P", r2.token_ids + [12, 13], max_tokens=2)
    h.run()
    assert r3.num_cached_tokens > 0 and h.s.stats.pins_hit == 2
    assert h.s.policy.tool_stats.count(NO_TOOL_CALL) == 1
    assert h.s.policy.tool_stats.global_count() == 1
    h.s.end_program("P")
    assert h.kv.num_free_blocks == h.kv.num_blocks


def test_vllm_fcfs_never_pins_but_prefix_cache_still_hits():
    h = Harness("vllm-fcfs")
    r1 = _turn1(h)
    assert not h.kv.pins
    r2 = h.req("t2", "P", r1.token_ids + [1, 2], max_tokens=2)
    h.run()
    assert r2.num_cached_tokens == 20
    assert h.s.stats.pins_hit == 0


def test_pin_expires_at_ttl_without_waiting_request():
    h = Harness("continuum")
    _turn1(h, ttl_hint=0.5)
    pin = h.kv.pins["P"]
    t_pin = pin.expiry - 0.5
    h.clock.advance_to(t_pin + 0.4)
    h.idle(0.0)
    assert "P" in h.kv.pins
    h.idle(0.1)  # now == expiry
    assert "P" not in h.kv.pins
    assert h.s.stats.pins_expired == 1
    assert h.kv.num_free_blocks == h.kv.num_blocks


def test_pin_does_not_expire_while_program_waits():
    h = Harness("continuum", max_seqs=1)
    _turn1(h, ttl_hint=0.5)
    r1 = h.finished[-1]
    # another program occupies the only running slot for a long while
    blocker = h.req("blk", "Q", prompt_of(5, 4), max_tokens=200)
    h.step()
    r2 = h.req("t2", "P", r1.token_ids + [1, 2, 3], max_tokens=2)
    h.run(until=lambda: h.clock.now() > h.kv.pins["P"].expiry + 0.5 if "P" in h.kv.pins else True)
    assert "P" in h.kv.pins, "the pin expired while its program had a request waiting"
    assert r2.status is RequestStatus.WAITING
    assert h.s.stats.pins_expired == 0
    h.run()
    assert r2.num_cached_tokens == 20
    assert h.s.stats.pins_hit == 1
    assert blocker.output_token_ids == expected(blocker.prompt_token_ids, 200)


def test_end_of_program_releases_pin():
    h = Harness("continuum", reload_cost=reload_cost)
    a = h.req("a", "P", prompt_of(1, 10), max_tokens=2, tool_name="grep")
    b = h.req("b", "P", prompt_of(2, 10), max_tokens=12, is_last_turn=True)
    h.run(until=lambda: a.is_finished)
    assert "P" in h.kv.pins and not b.is_finished
    h.run()
    assert b.is_finished
    assert "P" not in h.kv.pins
    assert h.s.stats.pins_released_at_end == 1
    assert "P" not in h.s.programs
    assert h.kv.num_free_blocks == h.kv.num_blocks


def test_last_turn_is_not_pinned_and_end_program_releases():
    h = Harness("continuum", reload_cost=reload_cost)
    r = h.req("a", "P", prompt_of(1, 10), max_tokens=2, tool_name="grep", is_last_turn=True)
    h.run()
    assert r.is_finished and not h.kv.pins
    _turn1(h, pid="Q")
    assert "Q" in h.kv.pins
    h.s.end_program("Q")
    assert "Q" not in h.kv.pins and h.s.stats.pins_released_at_end == 1
    h.s.check_integrity()
    _turn1(h, pid="R", rid="r1")
    assert h.s.release_program("R") is True
    assert h.s.release_program("R") is False
    assert "R" in h.s.programs
    assert h.kv.num_free_blocks == h.kv.num_blocks


def test_pins_are_reclaimed_latest_program_first_no_deadlock():
    h = Harness("continuum", num_blocks=32)
    for i in range(8):
        h.clock.advance(1.0)
        _turn1(h, pid=f"P{i}", rid=f"t{i}", n=12, max_tokens=3, ttl_hint=100.0)
    assert len(h.kv.pins) == 8
    assert h.kv.num_free_blocks == 0
    assert h.kv.num_pinned_blocks == 32
    # a new program's request that needs 20 blocks, nothing running
    big = h.req("new", "NEW", prompt_of(777, 70), max_tokens=5)
    h.run(max_steps=200)
    assert big.output_token_ids == expected(big.prompt_token_ids, 5)
    assert h.s.stats.pins_reclaimed >= 1
    # the latest-arriving programs lost their pins first
    left = sorted(h.kv.pins)
    assert left == [f"P{i}" for i in range(len(left))]
    assert len(left) <= 3


def test_pin_reclaim_respects_program_arrival_while_something_runs():
    """While something runs, a waiting request may only reclaim pins of programs
    that arrived after its own (latest first, only as many as needed); once
    nothing runs, any pin."""
    h = Harness("continuum", num_blocks=20, max_seqs=4)
    h.clock.advance(1.0)
    _turn1(h, pid="EARLY", rid="e1", n=12, max_tokens=3, ttl_hint=100.0)  # 4 blocks
    h.clock.advance(1.0)
    _turn1(h, pid="LATE", rid="l1", n=12, max_tokens=3, ttl_hint=100.0)  # 4 blocks
    runner = h.req("run", "RUN", prompt_of(3, 7), max_tokens=20)  # 2 .. 7 blocks
    h.step()
    h.s.programs.touch("MID", 1.5)  # arrived between EARLY and LATE
    mid = h.req("mid", "MID", prompt_of(4, 40), max_tokens=2)  # 10 blocks: LATE's suffice
    h.run(until=lambda: mid.is_finished)
    assert "LATE" not in h.kv.pins and "EARLY" in h.kv.pins
    assert h.s.stats.pins_reclaimed == 1
    h.s.programs.touch("MID2", 1.5)
    mid2 = h.req("mid2", "MID2", prompt_of(5, 66), max_tokens=2)  # 17 blocks: needs EARLY's too
    h.run(until=lambda: runner.is_finished)
    assert "EARLY" in h.kv.pins, "reclaimed an earlier program's pin while something ran"
    assert mid2.status is RequestStatus.WAITING
    h.run()
    state = (f"pins={sorted(h.kv.pins)} reclaimed={h.s.stats.pins_reclaimed} "
             f"mid2={mid2.status} out={mid2.output_token_ids} preemptions={h.s.stats.preemptions} "
             f"steps={len(h.outputs)} now={h.clock.now():.2f}")
    assert "EARLY" not in h.kv.pins, state
    assert h.s.stats.pins_reclaimed == 2, state
    assert mid2.output_token_ids == expected(mid2.prompt_token_ids, 2)
    assert runner.output_token_ids == expected(runner.prompt_token_ids, 20)


def test_own_pin_does_not_deadlock_a_big_next_turn():
    """The next turn needs nearly the whole cache and its own program's pin holds
    blocks the turn does not reuse (the partial last block): with nothing
    running and no other pin to reclaim it must still be admitted."""
    h = Harness("continuum", num_blocks=10)
    r1 = _turn1(h, n=15, max_tokens=3, ttl_hint=100.0)
    assert h.kv.num_pinned_blocks == 5
    p2 = r1.token_ids + prompt_of(5, 20)  # 38 tokens + 1 = 10 blocks, 4 of them pinned hits
    r2 = h.req("t2", "P", p2, max_tokens=1)
    h.run(max_steps=50)
    assert r2.output_token_ids == expected(p2, 1)
    assert r2.num_cached_tokens == 16
    assert h.kv.num_free_blocks == h.kv.num_blocks


# ---------------------------------------------------------------- priority orders


def _prog(pid, arrival, service=0.0):
    p = ProgramState(pid, arrival)
    p.attained_service = service
    return p


def _r(rid, pid, arrival, preempted=False, waiting_since=None):
    r = Request(rid, pid, [1, 2, 3], 1, arrival_time=arrival)
    r.preempted = preempted
    if waiting_since is not None:
        r.waiting_since = waiting_since
    return r


def test_program_fcfs_orders_by_program_arrival():
    h = Harness("program-fcfs", max_seqs=1)
    a1 = h.req("a1", "A", prompt_of(1, 5), max_tokens=1)
    h.clock.advance(1.0)
    b1 = h.req("b1", "B", prompt_of(2, 5), max_tokens=1)
    h.run()
    blocker = h.req("blk", "Z", prompt_of(3, 5), max_tokens=30)
    h.step()
    h.clock.advance(1.0)
    b2 = h.req("b2", "B", b1.token_ids + [1], max_tokens=1)  # B's turn arrives first ...
    h.clock.advance(1.0)
    a2 = h.req("a2", "A", a1.token_ids + [1], max_tokens=1)  # ... but A is the older program
    h.run()
    assert h.admission_order[-2:] == ["a2", "b2"]
    # vllm-fcfs would go by request arrival instead
    v = Harness("vllm-fcfs")
    pa, pb = v.s.programs.touch("A", 0.0), v.s.programs.touch("B", 1.0)
    assert v.s.policy.priority(_r("b2", "B", 5.0), pb, 9.0) < v.s.policy.priority(_r("a2", "A", 6.0), pa, 9.0)
    assert h.s.policy.priority(_r("a2", "A", 6.0), pa, 9.0) < h.s.policy.priority(_r("b2", "B", 5.0), pb, 9.0)


def test_continuum_order_preempted_then_pinned_then_arrival():
    h = Harness("continuum", max_seqs=1)
    pol = h.s.policy
    # programs: A oldest and unpinned, B pinned, C preempted and youngest
    h.s.programs.touch("A", 0.0)
    _turn1(h, pid="B", rid="b1", ttl_hint=100.0)
    h.s.programs.touch("C", 50.0)
    now = h.clock.now()
    pa, pb, pc = h.s.programs.get("A"), h.s.programs.get("B"), h.s.programs.get("C")
    ka = pol.priority(_r("a", "A", 1.0), pa, now)
    kb = pol.priority(_r("b", "B", 2.0), pb, now)
    kc = pol.priority(_r("c", "C", 3.0, preempted=True), pc, now)
    assert kc < kb < ka
    # and through the scheduler: the waiting queue is sorted that way
    blocker = h.req("blk", "Z", prompt_of(3, 5), max_tokens=30)
    h.step()
    ra = h.req("a", "A", prompt_of(11, 5), max_tokens=1)
    rb = h.req("b2", "B", h.finished[-1].token_ids + [1, 2], max_tokens=1)
    h.step()
    assert [r.request_id for r in h.s.waiting] == ["b2", "a"]
    h.run()
    assert h.admission_order[-2:] == ["b2", "a"]
    assert rb.num_cached_tokens > 0 and h.s.stats.pins_hit == 1


def test_release_program_reorders_waiting():
    """After a client releases a pin, the program's waiting request loses its
    pinned-first place in the queue."""
    h = Harness("continuum", max_seqs=1)
    h.s.programs.touch("A", 0.0)
    _turn1(h, pid="B", rid="b1", ttl_hint=100.0)
    h.req("blk", "Z", prompt_of(3, 5), max_tokens=10)
    h.step()
    h.req("a", "A", prompt_of(11, 5), max_tokens=1)
    h.clock.advance(0.001)
    h.req("b2", "B", h.finished[-1].token_ids + [1, 2], max_tokens=1)
    h.step()
    assert [r.request_id for r in h.s.waiting] == ["b2", "a"]
    assert h.s.release_program("B")
    h.run()
    assert h.admission_order[-2:] == ["a", "b2"]


def test_autellix_least_attained_service_first_and_starvation():
    h = Harness("autellix", max_seqs=1, step_time=0.5)
    heavy1 = h.req("h1", "H", prompt_of(1, 5), max_tokens=8)  # 8 steps x 0.5 s = 4 s of service
    h.run()
    assert h.s.programs.get("H").attained_service == pytest.approx(4.0)
    blocker = h.req("blk", "Z", prompt_of(3, 5), max_tokens=2)
    h.step()
    h2 = h.req("h2", "H", heavy1.token_ids + [1], max_tokens=1)
    h.clock.advance(0.1)
    l1 = h.req("l1", "L", prompt_of(2, 5), max_tokens=1)  # later, but no service yet
    h.run()
    assert h.admission_order[-2:] == ["l1", "h2"]
    pol = h.s.policy
    heavy = _prog("H", 0.0, service=4.0)
    light = _prog("L", 0.0, service=0.0)
    now = 100.0
    # a fresh request of a heavy program waits behind a light one ...
    assert pol.priority(_r("x", "L", now, waiting_since=now - 1), light, now) < \
        pol.priority(_r("y", "H", now, waiting_since=now - 2), heavy, now)
    # ... until it waited beta x its service: then it is promoted to the top
    # level, and the longer wait wins among equals
    starving = _r("y", "H", 0.0, waiting_since=now - 8.0 * 4.0)
    assert pol.priority(starving, heavy, now) < pol.priority(_r("x", "L", now, waiting_since=now - 1), light, now)
    # preempted first of all
    assert pol.priority(_r("z", "H", 0.0, preempted=True, waiting_since=now), heavy, now) < \
        pol.priority(starving, heavy, now)


def test_autellix_starving_request_promoted_in_scheduler():
    h = Harness("autellix", max_seqs=1, step_time=0.5)
    heavy1 = h.req("h1", "H", prompt_of(1, 5), max_tokens=8)  # 4 s of service: level 3
    h.run()
    h.req("blk", "Z", prompt_of(3, 5), max_tokens=80)  # 40 s busy, gains service fast
    h.step()
    h2 = h.req("h2", "H", heavy1.token_ids + [1], max_tokens=1)
    # light programs keep arriving; h2 waits 8 x 4 s = 32 s and then beats them
    for i in range(10):
        h.run(until=lambda: h.clock.now() >= 3.0 * (i + 2))
        h.req(f"l{i}", f"L{i}", prompt_of(20 + i, 5), max_tokens=1)
    h.run()
    assert h.admission_order == ["h1", "blk", "h2"] + [f"l{i}" for i in range(10)]


def test_autellix_without_promotion_heavy_program_waits_behind_light_ones():
    h = Harness("autellix", max_seqs=1, step_time=0.5)
    h.s.policy.beta = 1e9  # never starving
    heavy1 = h.req("h1", "H", prompt_of(1, 5), max_tokens=8)
    h.run()
    h.req("blk", "Z", prompt_of(3, 5), max_tokens=80)
    h.step()
    h.req("h2", "H", heavy1.token_ids + [1], max_tokens=1)
    for i in range(10):
        h.run(until=lambda: h.clock.now() >= 3.0 * (i + 2))
        h.req(f"l{i}", f"L{i}", prompt_of(20 + i, 5), max_tokens=1)
    h.run()
    assert h.admission_order == ["h1", "blk"] + [f"l{i}" for i in range(10)] + ["h2"]


def test_infercept_preserve_short_tool_discard_long_tool():
    h = Harness("infercept", reload_cost=lambda n: 0.001 * n)
    pol = h.s.policy
    for _ in range(5):
        pol.tool_stats.record("fast", 0.001)
        pol.tool_stats.record("slow", 1000.0)
    r1 = h.req("f1", "F", prompt_of(1, 18), max_tokens=3, tool_name="fast")
    h.run()
    assert "F" in h.kv.pins and h.kv.pins["F"].expiry == pytest.approx(r1.finish_time + 2 * 0.001)
    r2 = h.req("s1", "S", prompt_of(2, 18), max_tokens=3, tool_name="slow")
    h.run()
    assert "S" not in h.kv.pins
    assert h.s.stats.pins_created == 1
    h.s.end_program("F")
    assert h.kv.num_free_blocks == h.kv.num_blocks
    # direct decisions
    req = _r("q", "Q", 0.0)
    req.tool_name, req.num_computed_tokens = "fast", 100
    assert pol.retention(req, _prog("Q", 0.0), 1.0).action == "pin"
    req.tool_name = "slow"
    assert pol.retention(req, _prog("Q", 0.0), 1.0).action == "free"
    req.tool_name = None
    assert pol.retention(req, _prog("Q", 0.0), 1.0).action == "free"


def test_infercept_swaps_with_host_tier_when_batch_is_small():
    """swap waste (2 x rebuild x batch) beats discard (rebuild x (own + batch))
    when the finished request is larger than the running batch."""
    h = Harness("infercept", host=64, budget=256, reload_cost=lambda n: 0.001 * n)
    pol = h.s.policy
    for _ in range(5):
        pol.tool_stats.record("slow", 1000.0)
    bg = h.req("bg", "BG", prompt_of(9, 3), max_tokens=40)  # a small running batch
    r = h.req("s1", "S", prompt_of(2, 60), max_tokens=2, tool_name="slow")
    h.run(until=lambda: r.is_finished)
    assert "S" not in h.kv.pins
    assert h.kv.host.num_used == 15  # its 15 full blocks were copied to the host at once
    assert sum(len(o.blocks_to_offload) for o in h.outputs) == 0  # the copies go out with the next step
    out, _ = h.step()
    assert len(out.blocks_to_offload) == 15
    h.run()
    assert bg.output_token_ids == expected(bg.prompt_token_ids, 40)
    # the next turn reloads from the host (or hits the device copies still cached)
    r2 = h.req("s2", "S", r.token_ids + [1, 2], max_tokens=1)
    h.run()
    assert r2.num_cached_tokens == 60
    assert r2.output_token_ids == expected(r2.prompt_token_ids, 1)


def test_infercept_review_drops_pin_when_batch_shrinks():
    """Preserve is chosen while a big batch makes discarding costly; once the
    batch is gone, discarding wastes less than the tool time that remains."""
    h = Harness("infercept", budget=256, reload_cost=lambda n: 0.01 * n)
    pol = h.s.policy
    for _ in range(5):
        pol.tool_stats.record("t", 1.0)
    bg = h.req("bg", "BG", prompt_of(9, 100), max_tokens=4)
    r = h.req("s1", "S", prompt_of(2, 18), max_tokens=2, tool_name="t")
    h.run(until=lambda: r.is_finished)
    assert "S" in h.kv.pins
    h.run(until=lambda: bg.is_finished)
    assert "S" in h.kv.pins
    h.idle(0.0)  # the next review sees an empty batch
    assert "S" not in h.kv.pins
    assert h.s.stats.pins_released_early == 1


def test_infercept_review_keeps_pin_once_next_turn_waits():
    """Once the program's next turn has arrived the tool is done: review must
    not drop the pin before that turn is admitted (it used to: the arrival
    forgot the expected duration and review fell back to the default)."""
    h = Harness("infercept", max_seqs=1, reload_cost=lambda n: 0.001 * n)
    pol = h.s.policy
    for _ in range(5):
        pol.tool_stats.record("fast", 0.001)
    r1 = h.req("f1", "F", prompt_of(1, 18), max_tokens=3, tool_name="fast")
    h.run()
    assert "F" in h.kv.pins
    blocker = h.req("blk", "Z", prompt_of(3, 5), max_tokens=5)
    h.step()
    r2 = h.req("f2", "F", r1.token_ids + [3, 4], max_tokens=2)
    h.run()
    assert r2.num_cached_tokens == 20
    assert h.s.stats.pins_hit == 1 and h.s.stats.pins_released_early == 0


# ---------------------------------------------------------------- randomized workloads


@pytest.mark.parametrize("policy", sorted(policy_names()))
@pytest.mark.parametrize("host", [0, 24])
@pytest.mark.parametrize("seed", range(4))
def test_random_agent_workload_completes_with_correct_outputs(policy, host, seed):
    """Many multi-turn programs on a small cache (preemptions, evictions,
    reloads, pin reclaims): every turn finishes (no deadlock), every output is
    the reference output, the KV checks and the executor's KV-content checks
    hold at every step, and all memory comes back at the end."""
    rng = random.Random(f"{policy}-{host}-{seed}")
    h = Harness(policy, num_blocks=24, budget=16, max_seqs=4, host=host,
                eviction=rng.choice(["lru", "leaf-lru", "lfu", "arc"]),
                reload_cost=lambda n: 0.02 * n)
    system = prompt_of(1, 9)
    programs = {}
    pending = []  # (time, program)
    for p in range(14):
        programs[f"P{p}"] = {"turns": rng.randrange(1, 6), "done": 0,
                             "ctx": list(system) + prompt_of(100 + p, rng.randrange(1, 12))}
        pending.append((rng.uniform(0, 0.2), f"P{p}"))
    checked = 0
    for _ in range(5000):
        now = h.clock.now()
        for t, pid in sorted(pending):
            if t <= now:
                pending.remove((t, pid))
                st = programs[pid]
                k = st["done"]
                max_tokens = rng.randrange(1, 12)
                last = k == st["turns"] - 1 or len(st["ctx"]) + max_tokens + 20 > h.kv.num_blocks * BS
                if last:
                    st["turns"] = k + 1
                h.req(f"{pid}-{k}", pid, st["ctx"], max_tokens=max_tokens,
                      tool_name=None if last else rng.choice(["a", "b", None]),
                      is_last_turn=last, ttl_hint=rng.choice([None, None, 0.05, 5.0]))
        if not h.s.has_work:
            if not pending:
                break
            h.idle(min(t for t, _ in pending) - now)
            continue
        _, fin = h.step()
        for r in fin:
            assert r.output_token_ids == expected(r.prompt_token_ids, r.max_tokens)
            checked += 1
            st = programs[r.program_id]
            st["done"] += 1
            if st["done"] < st["turns"]:
                st["ctx"] = r.token_ids + prompt_of(rng.randrange(10**6), rng.randrange(1, 10))
                pending.append((h.clock.now() + rng.choice([0.0, 0.02, 0.3]), r.program_id))
    assert not pending and not h.s.has_work, "workload did not finish"
    assert checked == sum(st["turns"] for st in programs.values())
    for pid in list(h.kv.pins):  # infercept pins have no expiry
        h.s.release_program(pid)
    h.s.check_integrity()
    assert h.kv.num_free_blocks == h.kv.num_blocks


def test_hybrid_late_turn_waits_for_its_prompt_instead_of_preempting_itself():
    """Under the hybrid cache a turn admitted without the headroom (late: only KV holds it back)
    on its first chunk alone found its next chunk's blocks and window parts taken by a growing
    decode and preempted itself, again and again (14 times here); it now waits until its own
    prompt fits, the running requests' reserves aside."""
    h = Harness("agentserve", num_blocks=28, budget=8, window=6, window_pages=2)
    h.s.policy.skips_headroom = lambda req, now: True  # every turn is admitted as a late one
    a = h.req("a", "pa", prompt_of(1, 8), max_tokens=40)
    for _ in range(3):
        h.step()
    b = h.req("b", "pb", prompt_of(2, 40), max_tokens=2)  # five chunks
    h.run()
    assert a.status is b.status is RequestStatus.FINISHED_LENGTH
    assert (a.num_preemptions, b.num_preemptions, h.s.stats.preemptions) == (0, 0, 0)
    assert b.output_token_ids == expected(prompt_of(2, 40), 2)
