"""Prompt-lookup speculation: the n-gram index, the step's draft plan, the
scheduler's verification and KV trimming (over a fake model that checks the
KV every chunk reads), and the real runner's output with and without drafts."""

from __future__ import annotations

import itertools

import random

import pytest

from agentserve.clock import SimClock
from agentserve.engine.executor import Executor, ExecutorResult
from agentserve.engine.request import Request, RequestStatus
from agentserve.engine.sampling_params import SamplingParams
from agentserve.engine.scheduler import Scheduler, SchedulerConfig
from agentserve.engine.scheduler_output import SchedulerOutput
from agentserve.engine.spec_decode import NgramIndex, SpecConfig, Speculator
from agentserve.kv.manager import KVCacheManager

BS = 4


# --- the n-gram index ---

def test_index_proposes_the_continuation_of_the_longest_latest_match():
    idx = NgramIndex(2, 4)
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix (2, 3) last occurred at 6..7 -> continuation from 8; the longer
    # (5, 2, 3) never occurred before, so the 2-gram decides
    assert idx.propose(tokens, 3) == [7, 8, 5]
    tokens += [7]  # now (2, 3, 7) matches at 6..8 -> 8, 5, 2
    assert idx.propose(tokens, 3) == [8, 5, 2]
    assert idx.propose([4, 5, 6], 3) == []  # a fresh index, no repeat: nothing


def test_index_never_matches_the_suffix_itself_and_stops_at_the_end():
    idx = NgramIndex(1, 3)
    assert idx.propose([5, 6], 4) == []
    assert idx.propose([5, 6, 5], 4) == [6, 5]  # continuation runs up to the end of the tokens


def test_incremental_index_equals_a_fresh_one():
    rng = random.Random(1)
    tokens = [rng.randrange(6) for _ in range(40)]
    inc = NgramIndex(2, 4)
    for n in range(2, len(tokens)):
        fresh = NgramIndex(2, 4)
        assert inc.propose(tokens[:n], 5) == fresh.propose(tokens[:n], 5)


# --- the plan ---

class _Req:
    def __init__(self, tokens, max_tokens=100):
        self.token_ids = list(tokens)
        self.num_output_tokens = 0
        self.max_tokens = max_tokens
        self.sampling = SamplingParams()
        self.spec = None

    @property
    def num_tokens(self):
        return len(self.token_ids)


REPEAT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 3 + [1, 2, 3]


def test_plan_gives_a_lone_confident_decoder_its_whole_draft_and_a_busy_batch_less():
    spec = Speculator(SpecConfig(max_draft=6, initial_acceptance=0.9))
    one = _Req(REPEAT)
    plan = spec.plan([one], base_time=0.010, row_cost=0.001)
    assert plan[one] == [4, 5, 6, 7, 8, 9]
    # 16 decoders at the same acceptance: a row costs more tokens at the batch's rate
    many = [_Req(REPEAT) for _ in range(16)]
    plan = spec.plan(many, base_time=0.030, row_cost=0.001)
    assert sum(map(len, plan.values())) < 6 * 16
    assert all(len(d) <= 6 for d in plan.values())


def test_plan_holds_the_step_time_target():
    """The target is what a stream waits per token. While a decoding stream
    has no draft, the step's time is its inter-token latency: draft rows stop
    at the target, and a step already over it gets none. Once every stream
    carries a draft, each expects more than one token, and the step may take
    that many times the target. Without a target nothing changes."""
    spec = Speculator(SpecConfig(max_draft=4, initial_acceptance=0.9))
    many = [_Req(REPEAT) for _ in range(4)]
    plain = _Req(list(range(100, 140)))  # nothing repeats: no draft to offer
    free = spec.plan(many + [plain], base_time=0.100, row_cost=0.010)
    assert sum(map(len, free.values())) > 5 and spec.stats.capped_steps == 0
    capped = spec.plan(many + [plain], base_time=0.100, row_cost=0.010, max_time=0.155)
    assert sum(map(len, capped.values())) == 5 and spec.stats.capped_steps == 1
    assert spec.fewest_tokens == 1.0
    assert spec.plan(many + [plain], base_time=0.200, row_cost=0.010, max_time=0.150) == {}
    # every stream drafts: 16 rows make a 260 ms step, 4.1 tokens expected a stream (63 ms a token)
    drafted = spec.plan(many, base_time=0.100, row_cost=0.010, max_time=0.155)
    assert sum(map(len, drafted.values())) == 16 and spec.stats.capped_steps == 2  # (the {} above was one)
    assert spec.fewest_tokens == pytest.approx(1 + 0.9 + 0.81 + 0.729 + 0.6561)
    # a target no plan meets: the plan with the fewest seconds a token for the least-served stream
    assert sum(map(len, spec.plan(many, base_time=0.100, row_cost=0.010, max_time=0.050).values())) == 16
    # relative (unfitted) costs carry no seconds: the target cannot apply
    assert spec.plan(many, base_time=None, row_cost=None, max_time=0.001) != {}


class _StepCosts:
    """A fitted step-time model reduced to what plan_step asks: 50 ms for the
    decodes, 10 ms a draft row, `chunk` seconds for the smallest prefill chunk
    (a chunk's cost grows with the context it attends to)."""
    ready = True

    def __init__(self, chunk):
        self.chunk = chunk
        self.asked = []

    def base_time(self, rows, ctx):
        return 0.050

    def draft_row_time(self, ctx):
        return 0.010

    def chunk_time(self, start, n):
        self.asked.append((start, n))
        return self.chunk


def test_drafts_leave_a_waiting_prefill_its_smallest_chunk():
    """Drafts fill a step to its target only when no prefill waits; otherwise
    they stop where the chunk the scheduler always computes still fits, so that
    chunk cannot push the step past the target. (A second stream with nothing
    to draft keeps the target on the step's time.)"""
    spec = Speculator(SpecConfig(max_draft=30, initial_acceptance=0.99))
    one = _Req(REPEAT * 3)
    one.num_computed_tokens = len(one.token_ids) - 1
    plain = _Req(list(range(100, 140)))
    plain.num_computed_tokens = len(plain.token_ids) - 1

    def rows(costs, at, decoding=(one, plain)):
        return len(spec.plan_step(list(decoding), costs, spare_blocks=8, max_time=0.120, prefill_at=at,
                                  min_chunk=32).get(one, ()))

    assert rows(_StepCosts(0.020), None) == 7  # (0.120 - 0.050) / 0.010
    deep = _StepCosts(0.045)
    assert rows(deep, 6000) == 2  # 0.120 - 0.045 leaves 25 ms for drafts
    assert deep.asked == [(6000, 32)]
    assert rows(_StepCosts(0.300), 6000) == 0  # the chunk alone fills the step
    # alone, the stream expects ~1 token a draft row: the step may pass 120 ms, a token may not
    alone = rows(_StepCosts(0.045), 6000, decoding=(one,))
    assert alone > 7 and 0.050 + 0.010 * alone + 0.045 <= 0.120 * spec.fewest_tokens


def test_plan_skips_low_acceptance_and_finishing_requests():
    spec = Speculator(SpecConfig(max_draft=6))
    low = _Req(REPEAT)
    spec.state(low).acceptance = 0.05
    last = _Req(REPEAT, max_tokens=1)  # its next token is its last: nothing to draft
    assert spec.plan([low, last], base_time=0.010, row_cost=0.002) == {}
    assert low.spec.shadow == 4  # the draft it did not verify is checked against its next token
    spec.observe_shadow(low, 4)
    assert low.spec.acceptance > 0.05


def test_acceptance_estimate_follows_what_verification_finds():
    spec = Speculator(SpecConfig(max_draft=4, initial_acceptance=0.5))
    r = _Req(REPEAT)
    for _ in range(10):
        spec.observe(r, 4, 4)
    assert r.spec.acceptance > 0.95
    for _ in range(10):
        spec.observe(r, 4, 0)
    assert r.spec.acceptance < 0.1


def test_config_is_validated():
    with pytest.raises(ValueError, match="max_draft"):
        SpecConfig(max_draft=-1)
    with pytest.raises(ValueError, match="ngram"):
        SpecConfig(max_draft=2, min_ngram=3, max_ngram=2)


# --- the scheduler, over a fake model that checks the KV it reads ---

def model(ctx) -> int:
    """Mostly repeats the token 5 back (prompt lookup predicts it), sometimes not."""
    h = 0
    for t in ctx[-6:]:
        h = (h * 31 + t) % 1009
    if len(ctx) % 7 == 3:
        return 20 + h % 30
    return ctx[-5]


def plain(prompt, n, eos=None):
    ctx, out = list(prompt), []
    for _ in range(n):
        t = model(ctx)
        out.append(t)
        ctx.append(t)
        if t == eos:
            break
    return out


class VerifyingExecutor(Executor):
    """Writes each chunk's tokens as its 'KV', checks that every position a
    chunk reads holds the request's token, and samples every draft position."""

    def __init__(self, clock: SimClock) -> None:
        self.clock = clock
        self.dev: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.rows = 0

    def execute(self, out: SchedulerOutput) -> ExecutorResult:
        for d, h in out.blocks_to_offload:
            self.host[h] = list(self.dev.get(d, [None] * BS))
        for h, d in out.blocks_to_load:
            self.dev[d] = list(self.host[h])
        sampled = {}
        for ch in out.chunks:
            req = ch.request
            table = req.block_table.block_ids
            toks = ch.token_ids
            assert len(toks) == ch.num_tokens and len(table) * BS >= ch.start + ch.num_tokens
            for pos in range(ch.start):
                blk = self.dev.get(table[pos // BS])
                assert blk is not None and blk[pos % BS] == req.token_ids[pos], f"stale KV at {pos}"
            for i, pos in enumerate(range(ch.start, ch.start + ch.num_tokens)):
                self.dev.setdefault(table[pos // BS], [None] * BS)[pos % BS] = toks[i]
            self.rows += ch.num_tokens
            if ch.sample:
                ctx = req.token_ids[:ch.start] + toks
                first = len(ctx) - len(ch.draft) - 1
                sampled[req.request_id] = [model(ctx[:first + 1 + j]) for j in range(len(ch.draft) + 1)]
        self.clock.advance(0.01)
        return ExecutorResult(sampled, 0.01)


_REQUEST_NUMBERS = itertools.count()


def run(prompts, max_tokens, spec: int, num_blocks=64, policy="continuum", eos=None, budget=64, harness=None):
    clock, s, ex = harness or _harness(spec, num_blocks, policy, budget)
    reqs = []
    for i, p in enumerate(prompts):
        r = Request(f"r{next(_REQUEST_NUMBERS)}-{i}", f"p{i}", list(p), max_tokens, arrival_time=clock.now(),
                    eos_token_ids=frozenset() if eos is None else frozenset([eos]))
        s.add_request(r)
        reqs.append(r)
    steps = 0
    while s.has_work:
        out = s.schedule()
        s.check_integrity()
        s.update(out, ex.execute(out))
        s.check_integrity()
        for r in s.running:
            assert r.num_computed_tokens <= r.num_tokens - 1 or not r.output_token_ids
        steps += 1
        assert steps < 5000
    return reqs, s, ex, steps


def _harness(spec, num_blocks=64, policy="continuum", budget=64, host_blocks=0):
    clock = SimClock()
    kv = KVCacheManager(num_blocks, BS, host_blocks=host_blocks)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, speculation=SpecConfig(max_draft=spec)),
                  kv, policy, clock)
    return clock, s, VerifyingExecutor(clock)


def prompts(n, length=24, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, 9) for _ in range(length)] for _ in range(n)]


@pytest.mark.parametrize("n, blocks", [(1, 64), (6, 64), (6, 40)])
def test_speculative_output_equals_plain_decoding_and_takes_fewer_steps(n, blocks):
    ps = prompts(n)
    reqs, s, ex, steps = run(ps, 40, spec=6, num_blocks=blocks)
    for r, p in zip(reqs, ps):
        assert r.output_token_ids == plain(p, 40)
    st = s.speculator.stats
    assert st.accepted_tokens > 0 and st.fallbacks == 0
    _, _, _, plain_steps = run(ps, 40, spec=0, num_blocks=blocks)
    assert steps < plain_steps
    assert s.kv.num_free_blocks + s.kv.num_pinned_blocks <= s.kv.num_blocks


def test_a_stop_token_inside_an_accepted_draft_ends_the_output_there():
    p = [3, 1, 4, 1, 5] * 4
    full = plain(p, 30)
    eos = full[12]
    want = plain(p, 30, eos=eos)
    h = _harness(8)
    reqs, s, _, _ = run([p], 30, spec=8, eos=eos, harness=h)
    r = reqs[0]
    assert r.output_token_ids == want and r.status is RequestStatus.FINISHED_STOPPED
    # the next turn reuses the KV of exactly the tokens kept (the executor checks every position it reads)
    nxt, *_ = run([r.token_ids + [2, 3]], 4, spec=8, harness=h)
    assert nxt[0].num_cached_tokens == (r.num_tokens - 1) // BS * BS


def test_drafts_respect_max_tokens():
    reqs, _, _, _ = run(prompts(3), 9, spec=8)
    assert all(r.num_output_tokens == 9 for r in reqs)


def test_speculation_never_preempts_or_reclaims():
    # a cache just big enough for the requests themselves: drafts must not take their blocks
    ps = prompts(4, length=16)
    _, s, _, _ = run(ps, 24, spec=8, num_blocks=4 * 11)
    assert s.stats.preemptions == run(ps, 24, spec=0, num_blocks=4 * 11)[1].stats.preemptions


def test_a_wrong_shaped_result_falls_back_to_plain_decoding():
    class Short(VerifyingExecutor):
        def execute(self, out):
            res = super().execute(out)
            for ch in out.chunks:
                if ch.draft:
                    res.sampled[ch.request.request_id] = res.sampled[ch.request.request_id][:1]
            return res

    clock = SimClock()
    kv = KVCacheManager(64, BS)
    s = Scheduler(SchedulerConfig(speculation=SpecConfig(max_draft=4)), kv, "continuum", clock)
    ex = Short(clock)
    p = [3, 1, 4, 1, 5] * 4
    r = Request("r", "p", p, 20, arrival_time=0.0)
    s.add_request(r)
    while s.has_work:
        out = s.schedule()
        s.update(out, ex.execute(out))
        s.check_integrity()
    assert r.output_token_ids == plain(p, 20)
    assert s.speculator.stats.fallbacks > 0


# --- the real runner ---

@pytest.fixture(scope="module")
def hf():
    from tiny_models import hf_llama
    return hf_llama(seed=3)


def _llm(hf, spec):
    from agentserve.llm import LLM
    from tiny_models import DEVICE, loaded
    return LLM(loaded(hf), dtype="float32", device=DEVICE, kv_cache_tokens=4096, block_size=4,
               speculate=spec)


def test_runner_greedy_output_is_token_exact_with_speculation(hf):
    ps = [[(7 * i) % 50 + 60 for i in range(30)] * 2, [97, 98, 99, 100] * 12, list(range(60, 120))]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    base = [o.token_ids for o in _llm(hf, 0).generate(ps, params)]
    llm = _llm(hf, 8)
    got = [o.token_ids for o in llm.generate(ps, params)]
    assert got == base
    st = llm.scheduler.speculator.stats
    assert st.draft_tokens > 0 and st.accepted_tokens > 0
    llm.check_integrity()


def test_runner_seeded_sampling_is_the_same_token_for_token_with_speculation(hf):
    # The third request samples near greedy, whose output repeats its prompt (see
    # the greedy test), so drafts are proposed whatever random stream the device's
    # generator gives the others (CUDA's differs from the CPU's).
    ps = [[97, 98, 99, 100] * 12, list(range(60, 100)) * 2, [(7 * i) % 50 + 60 for i in range(30)] * 2]
    params = [SamplingParams(max_tokens=40, temperature=0.7, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.05, seed=7, ignore_eos=True)]
    base = [o.token_ids for o in _llm(hf, 0).generate(ps, params)]
    llm = _llm(hf, 8)
    assert [o.token_ids for o in llm.generate(ps, params)] == base
    assert llm.scheduler.speculator.stats.draft_tokens > 0


# --- counted where operators look ---

def test_speculation_and_grouped_prefill_in_the_stats_line_and_metrics():
    from dataclasses import replace

    from agentserve.engine.spec_decode import SpecStats
    from agentserve.server.metrics import ServerMetrics
    from agentserve.server.stats_log import stats_line
    from test_stats_log import snap

    a = snap(steps=10, executed_steps=10, decode_tokens=0, execute_s=1.0)
    b = a.but(steps=60, executed_steps=60, decode_tokens=120, execute_s=6.0,
                speculation=SpecStats(steps=40, draft_tokens=100, accepted_tokens=70), grouped_requests=3)
    line = stats_line(a, b, 10.0)
    assert "speculation 70/100 draft tokens accepted (70%), 2.40 tokens a step" in line
    assert "3 requests waited for a shared prefix's prefill" in line
    assert "speculation" not in stats_line(a, b.but(speculation=SpecStats()), 10.0)
    text = ServerMetrics("m").render(b).decode()
    assert 'agentserve:spec_accepted_tokens_total{model_name="m"} 70.0' in text
    assert 'agentserve:spec_draft_tokens_total{model_name="m"} 100.0' in text
    assert 'agentserve:grouped_prefill_requests_total{model_name="m"} 3.0' in text


def test_runner_speculates_under_a_tool_grammar_with_the_same_call(hf):
    pytest.importorskip("xgrammar")
    from test_runner_engine import WEATHER_TOOLS

    msgs = [{"role": "user", "content": 'weather? call get_weather {"city": "Oslo", "unit": "c"}'}]
    outs = []
    for spec in (0, 8):
        llm = _llm(hf, spec)
        for choice in ("required", "get_weather"):
            out = llm.chat(msgs, SamplingParams(max_tokens=200, temperature=0.0), tools=WEATHER_TOOLS,
                           tool_choice=choice)
            assert len(out.tool_calls) == 1, out.output.text
            outs.append(out.output.token_ids)
        llm.check_integrity()
    assert outs[:2] == outs[2:]
    st = llm.scheduler.speculator.stats
    assert st.draft_tokens > 0 and st.accepted_tokens > 0


def test_step_time_model_learns_what_a_draft_row_costs():
    from agentserve.engine.step_time import StepTimeModel, attention_pairs

    rng = random.Random(4)
    m = StepTimeModel(window=256)
    a, b, c, d, e, f, g = 0.004, 2e-4, 3e-7, 1e-3, 5e-7, 1.2e-3, 4.5e-7
    for _ in range(300):
        ctx = rng.randrange(100, 6000)
        if rng.random() < 0.3:
            p = rng.randrange(16, 512)
            m.observe(p, attention_pairs(ctx, p), 1, ctx + 1, a + b * p + c * attention_pairs(ctx, p) + d + e * ctx)
        else:
            r = rng.randrange(0, 9)
            rk = r * (ctx + 1) + r * (r + 1) // 2
            rows = rng.randrange(1, 4)
            m.observe(0, 0, rows, rows * ctx, a + d * rows + e * rows * ctx + f * r + g * rk, r, rk)
    assert m.draft_coefficients == pytest.approx((f, g), rel=0.05)
    assert m.draft_row_time(6000) == pytest.approx(m.margin * (f + g * 6000), rel=0.05)
    assert m.draft_row_time(6000) > 2 * m.draft_row_time(100)


def test_speculation_with_the_host_tier_across_turns():
    # a small device cache and a host tier: programs' KV is evicted to host and reloaded
    # between turns while their decodes verify drafts; every position read is checked
    h = _harness(8, num_blocks=30, policy="vllm-fcfs", host_blocks=200)
    convs = prompts(4, length=20, seed=5)
    for turn in range(3):
        reqs, s, ex, _ = run(convs, 16, spec=8, harness=h)
        for r, p in zip(reqs, convs):
            assert r.output_token_ids == plain(p, 16)
        convs = [r.token_ids + [1 + turn, 2] for r in reqs]
    assert s.stats.loaded_tokens > 0 and s.speculator.stats.accepted_tokens > 0
