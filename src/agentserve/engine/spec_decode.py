"""Prompt-lookup speculation: drafts from the request's own tokens, and how
many of them a step verifies.

A draft is the continuation of the most recent earlier occurrence of the
longest n-gram (n from `max_ngram` down to `min_ngram`) that ends the
request's tokens, prompt and output alike: tool names, argument keys and
file paths an agent writes have mostly appeared in its conversation before.
Each request keeps an index from n-grams to where they last occurred, brought
up to date with its new tokens before each proposal, so a proposal costs a
few dictionary lookups however long the conversation.

Which draft tokens a step verifies is a throughput decision for the whole
batch, not one per request: the j-th draft token of a request whose tokens
are accepted with probability `a` (its acceptance EMA) is worth a^j expected
tokens, and costs one more row of the step. Draft tokens are taken best
first while their worth exceeds their row's cost in tokens at the step's
current rate (tokens per second, both from the step-time model), so one
decoder with a well-predicted tool call verifies many, eight decoders verify
only near-certain ones, and novel prose verifies none (the paper's cap,
joint in the number of decoders and the acceptance history). A request whose
draft was not verified still learns: its first draft token is checked
against the token it sampled, at no cost, so its EMA can recover."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass
class SpecConfig:
    max_draft: int = 0  # draft tokens per request and step at most (0: speculation off)
    min_ngram: int = 2
    max_ngram: int = 4
    max_step_rows: int = 24  # rows of a step (decodes plus draft tokens) speculation may fill up to
    initial_acceptance: float = 0.6  # a new request's acceptance estimate
    ema_weight: float = 0.3  # weight of the latest step's observation in the estimate
    # Without a fitted step-time model: a draft token's row costs this share of a one-row step.
    default_row_cost: float = 0.25

    def __post_init__(self) -> None:
        if self.max_draft < 0:
            raise ValueError("max_draft must be >= 0 (0: speculation off)")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if not 0.0 < self.initial_acceptance <= 1.0 or not 0.0 < self.ema_weight <= 1.0:
            raise ValueError("initial_acceptance and ema_weight must be in (0, 1]")

    @property
    def enabled(self) -> bool:
        return self.max_draft > 0


# A fitted row cost below this share of the step is taken as this share (a fit
# that dropped the per-row coefficient would otherwise make drafts look free).
MIN_ROW_SHARE = 0.05


class NgramIndex:
    """n-gram -> position right after its latest occurrence whose continuation
    is known, for each n in [min_n, max_n]; fed incrementally."""

    __slots__ = ("min_n", "max_n", "maps", "indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.maps: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]
        self.indexed = 0  # tokens[:indexed] have their n-grams recorded

    def extend(self, tokens: list[int]) -> None:
        # The n-gram ending just before position p is recorded once tokens[p] exists:
        # the last token's own n-grams stay out, so a lookup never finds the suffix itself.
        lo, hi = self.min_n, self.max_n
        for p in range(max(self.indexed, 1), len(tokens)):
            for n in range(lo, min(hi, p) + 1):
                self.maps[n - lo][tuple(tokens[p - n:p])] = p
        self.indexed = max(self.indexed, len(tokens))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens continuing the longest matching suffix n-gram."""
        self.extend(tokens)
        L = len(tokens)
        for n in range(min(self.max_n, L), self.min_n - 1, -1):
            p = self.maps[n - self.min_n].get(tuple(tokens[L - n:]))
            if p is not None:
                return tokens[p:p + k]
        return []


@dataclass
class SpecState:
    """One request's speculation: its n-gram index and acceptance estimate."""
    index: NgramIndex
    acceptance: float
    shadow: int | None = None  # first token of a draft not verified this step, checked for free
    proposed: int = 0
    accepted: int = 0


@dataclass
class SpecStats:
    steps: int = 0  # steps that verified at least one draft token
    draft_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # of those, accepted
    fallbacks: int = 0  # verifications found inconsistent and decoded plainly instead
    capped_steps: int = 0  # steps whose drafts stopped short at the step-time target


@dataclass
class _Candidate:
    req: object
    draft: list[int]
    acceptance: float
    taken: int = 0
    expected: float = 0.0  # draft tokens its taken rows are expected to yield
    state: SpecState | None = field(default=None, repr=False)


class Speculator:
    def __init__(self, config: SpecConfig) -> None:
        self.config = config
        self.stats = SpecStats()
        # tokens the least-served decoding stream expects from the last planned step (1: a plain decode);
        # the scheduler copies it into the step's budget
        self.fewest_tokens = 1.0

    def state(self, req) -> SpecState:
        st = req.spec
        if st is None:
            c = self.config
            st = req.spec = SpecState(NgramIndex(c.min_ngram, c.max_ngram), c.initial_acceptance)
        return st

    def plan(self, decoding: list, base_time: float | None, row_cost: float | None,
             max_time: float | None = None, reserve: float = 0.0) -> dict:
        """Drafts for this step's decoding requests: {request: draft tokens}.

        base_time: seconds the step takes without drafts; row_cost: seconds
        one more row adds (both from the step-time model; None: unknown yet,
        then the default row cost relative to a one-row step). max_time: the
        target (seconds) for what a decoding stream waits per token: the
        step's time over the tokens the least-served stream expects from it.
        A draft row is paid by every stream in the step, so while one stream
        has no draft the step's time is its inter-token latency and rows stop
        at the target (long contexts make rows dear); once every stream
        carries a draft, each expects more than one token and the step may
        take that much longer. `reserve`: seconds of the step kept for
        something else (a prefill chunk). Sets `fewest_tokens`."""
        c = self.config
        self.fewest_tokens = 1.0
        if not c.enabled or not decoding:
            return {}
        cands = []
        for req in decoding:
            room = req.max_tokens - req.num_output_tokens - 1
            if room <= 0:
                continue
            st = self.state(req)
            draft = st.index.propose(req.token_ids, min(c.max_draft, room))
            if draft:
                cands.append(_Candidate(req, draft, st.acceptance, state=st))
        if not cands:
            return {}
        rows = len(decoding)
        if base_time is None or row_cost is None or base_time <= 0:
            beta = c.default_row_cost
            base_time, row_cost = 1.0 + beta * (rows - 1), beta
            max_time = None  # (relative units: no target to hold)
        row_cost = max(row_cost, MIN_ROW_SHARE * base_time)
        time, gained = base_time, float(rows)
        bare = rows  # decoding streams with no draft row yet: each expects one token from the step
        order: list[_Candidate] = []  # the rows taken, best first
        states = [(time, 1.0)]  # after each row: the step's time, the fewest tokens a stream expects
        heap = [(-x.acceptance, i) for i, x in enumerate(cands)]
        heapq.heapify(heap)
        while heap and rows < c.max_step_rows:
            neg, i = heapq.heappop(heap)
            worth = -neg
            if worth * time <= row_cost * gained:  # worth per second below the step's rate
                break
            x = cands[i]
            bare -= x.taken == 0
            x.taken += 1
            x.expected += worth
            order.append(x)
            rows += 1
            time += row_cost
            gained += worth
            states.append((time, 1.0 if bare else 1.0 + min(y.expected for y in cands)))
            if x.taken < len(x.draft):
                heapq.heappush(heap, (-(worth * x.acceptance), i))
        keep = len(order)
        if max_time is not None:
            keep = self._within(states, max_time, reserve)
            if keep < len(order):
                self.stats.capped_steps += 1
                for x in cands:
                    x.taken = 0
                for x in order[:keep]:
                    x.taken += 1
        self.fewest_tokens = states[keep][1]
        plan = {}
        for x in cands:
            if x.taken:
                plan[x.req] = x.draft[:x.taken]
                x.state.shadow = None
            else:
                x.state.shadow = x.draft[0]
        self.stats.steps += bool(plan)
        return plan

    @staticmethod
    def _within(states: list[tuple[float, float]], max_time: float, reserve: float) -> int:
        """Rows to keep of the planned ones: the most whose step stays within
        `max_time` a token for the least-served stream; where none does, the
        fewest seconds a token for it (a step already past the target without
        drafts is shortest per token when every stream gains)."""
        fits = [k for k, (t, fewest) in enumerate(states) if t + reserve <= max_time * fewest]
        if fits:
            return fits[-1]
        return min(range(len(states)), key=lambda k: ((states[k][0] + reserve) / states[k][1], k))

    def plan_step(self, decoding: list, step_model, spare_blocks: int, max_time: float | None = None,
                  prefill_at: int | None = None, min_chunk: int = 1) -> dict:
        """plan() for a scheduler step: costs from the step-time model once it
        is fitted, held under `max_time` seconds then; nothing when the cache
        has no block to spare per request.

        prefill_at: where the step's first prefill chunk would start (None: no
        prefill waits). The scheduler always computes a chunk of `min_chunk`
        tokens of a waiting prompt, so drafts stop short of the target by what
        that chunk costs there; otherwise drafts fill the step and the chunk
        overruns it (by far, when it attends to thousands of tokens).
        Only the smallest chunk: leaving drafts less time for a larger one
        was measured, and slowed the streams more than it sped first tokens."""
        if not self.config.enabled or not decoding or spare_blocks <= 0:
            self.fewest_tokens = 1.0
            return {}
        base = row = None
        reserve = 0.0
        if step_model.ready:
            rows = len(decoding)
            ctx = sum(r.num_computed_tokens + 1 for r in decoding)
            base = step_model.base_time(rows, ctx)
            row = step_model.draft_row_time(ctx // rows)
            if max_time is not None and prefill_at is not None:
                reserve = step_model.chunk_time(prefill_at, min_chunk)
        return self.plan(decoding, base, row, max_time, reserve)

    def verify(self, req, draft, sampled) -> list[int]:
        """The tokens a verified draft yields: the sampled token at each draft
        position while the draft agrees, then the first disagreeing one. A
        result of the wrong shape keeps only the first token (a plain decode)."""
        if len(sampled) != len(draft) + 1:
            self.stats.fallbacks += 1
            return list(sampled[:1])
        a = 0
        while a < len(draft) and sampled[a] == draft[a]:
            a += 1
        self.observe(req, len(draft), a)
        return list(sampled[:a + 1])

    def observe(self, req, draft_len: int, accepted: int) -> None:
        """After a verified step: `accepted` of `draft_len` draft tokens matched."""
        st = self.state(req)
        tested = accepted + (1 if accepted < draft_len else 0)
        self._learn(st, accepted / tested if tested else 1.0, tested)
        st.proposed += draft_len
        st.accepted += accepted
        s = self.stats
        s.draft_tokens += draft_len
        s.accepted_tokens += accepted

    def observe_shadow(self, req, sampled: int) -> None:
        """A request that decoded without its draft: was the draft's first token right?"""
        st = req.spec
        if st is None or st.shadow is None:
            return
        self._learn(st, 1.0 if sampled == st.shadow else 0.0, 1)
        st.shadow = None

    def _learn(self, st: SpecState, rate: float, weight: int) -> None:
        w = 1.0 - (1.0 - self.config.ema_weight) ** max(weight, 1)
        st.acceptance = min(1.0, max(0.02, (1.0 - w) * st.acceptance + w * rate))
