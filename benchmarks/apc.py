"""Prefix-cache (APC) hit ratio under each eviction strategy: the eviction
analysis of the KV-lifecycle design (section 1).

    python -m benchmarks apc --workload swebench --programs 100 --kv-blocks 2000,8000   (apc_cli.py)

replays a workload through the KV manager alone (no scheduler, no cost model,
no pins) and reports, per cache size and eviction strategy, the share of
prompt tokens served from the prefix cache, split into

* multi-turn hits: KV first computed by the same program group (an earlier
  call of the program, its parent or a sibling subagent), and
* cross-program hits: KV first computed by another program group (a shared
  system prompt),

next to an infinite cache (nothing is ever evicted): the upper bound, and the
loss of each strategy against it, split the same way.

Replay model. Calls are processed one at a time in arrival order. A call
arrives at its program's arrival plus the durations of the program's earlier
calls, where a call lasts its tool time plus, with `decode_tps`, its output
tokens / decode_tps (default 0: instant LLM calls, the generators' own
convention for `TraceCall.arrival`). Ties go by program order, then turn.
Each call: match its prompt (the hit), admit prompt + output, commit the KV
the engine would have computed (prompt + output - 1 tokens: the last sampled
token has none), free. Nothing holds blocks between calls, so the whole
device cache is prefix cache; only interleaving and the strategy decide what
survives. A call longer than the cache keeps only its first `num_blocks`
blocks (counted in `truncated_calls`).

Token ids come from `workload.tokens.program_token_plan` (as the simulator
builds them), so prefix reuse is exact. "First computed by" is recorded once
per block content, in an unbounded prefix index: that index is the infinite
cache."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from agentserve.kv.manager import KVCacheManager
from agentserve.kv.prefix_index import Node, PrefixIndex
from agentserve.workload.tokens import program_token_plan, shared_token_pool
from agentserve.workload.trace import Program, percentile

STRATEGIES = ("lru", "leaf-lru", "lfu", "arc")
DEFAULT_KV_BLOCKS = (2000, 8000)
INFINITE = "infinite"

# Row keys, in table order (JSON rows carry all of them).
ROW_KEYS = (
    "kv_blocks", "strategy", "prompt_tokens", "hit_tokens", "multi_turn_tokens", "cross_program_tokens",
    "hit_ratio", "multi_turn_ratio", "cross_program_ratio", "loss_pp", "loss_multi_turn_pp",
    "loss_cross_program_pp", "loss_multi_turn_share", "evictions", "truncated_calls",
)


# ---------------------------------------------------------------------------
# schedule


def call_order(programs: Sequence[Program], decode_tps: float = 0.0) -> list[tuple[float, int, int]]:
    """(arrival time, program index, turn) of every call, in processing order."""
    if decode_tps < 0 or math.isnan(decode_tps):
        raise ValueError(f"decode_tps must be >= 0, got {decode_tps}")
    out = []
    for i, p in enumerate(programs):
        t = p.arrival
        for k, c in enumerate(p.calls):
            out.append((t, i, k))
            d = c.tool_duration if math.isfinite(c.tool_duration) else 0.0
            t += max(0.0, d) + (c.output_tokens / decode_tps if decode_tps > 0 else 0.0)
    out.sort()
    return out


class _Plans:
    """Token plans built on a program's first call and dropped after its last."""

    def __init__(self, programs: Sequence[Program], seed: int) -> None:
        self.programs = programs
        self.seed = seed
        need = max((c.shared_prefix_tokens for p in programs for c in p.calls), default=0)
        self.shared = shared_token_pool(need, seed) if need else None
        self._plans: dict[int, list[tuple[list[int], list[int]]]] = {}

    def get(self, i: int, turn: int) -> tuple[list[int], list[int]]:
        plan = self._plans.get(i)
        if plan is None:
            plan = self._plans[i] = program_token_plan(self.programs[i], self.seed, shared_pool=self.shared)
        out = plan[turn]
        if turn == len(plan) - 1:
            del self._plans[i]
        return out


# ---------------------------------------------------------------------------
# the infinite cache: who computed each block first


class _Registry:
    """An unbounded prefix index; each node remembers the program group that
    computed its block first."""

    def __init__(self, block_size: int) -> None:
        self.index = PrefixIndex(block_size)
        self.owner: dict[Node, str] = {}

    def walk(self, token_ids: Sequence[int]) -> list[Node]:
        # The same cap as KVCacheManager.match: one token is always computed.
        return self.index.walk(token_ids, (len(token_ids) - 1) // self.index.block_size)

    def record(self, token_ids: Sequence[int], num_tokens: int, group: str) -> None:
        bs = self.index.block_size
        node = self.index.root
        for i in range(num_tokens // bs):
            node = self.index.get_or_create(node, tuple(token_ids[i * bs:(i + 1) * bs]))
            assert node is not None  # exact tuple keys cannot collide
            self.owner.setdefault(node, group)

    @property
    def num_blocks(self) -> int:
        return self.index.num_nodes


@dataclass
class _Tally:
    hit: int = 0
    multi: int = 0
    cross: int = 0
    truncated: int = 0

    def count(self, m: int, own: list[int]) -> None:
        """A hit of the first m blocks of a prompt."""
        self.hit += m
        self.multi += own[m]
        self.cross += m - own[m]


# ---------------------------------------------------------------------------
# the analysis


def _ratio(a: int, b: int) -> float:
    return a / b if b else 0.0


def _row(kv_blocks, strategy: str, prompt: int, t: _Tally, inf: _Tally | None, bs: int,
         evictions: int) -> dict:
    hit, multi, cross = (t.hit * bs, t.multi * bs, t.cross * bs)
    row = {
        "kv_blocks": kv_blocks, "strategy": strategy, "prompt_tokens": prompt,
        "hit_tokens": hit, "multi_turn_tokens": multi, "cross_program_tokens": cross,
        "hit_ratio": _ratio(hit, prompt), "multi_turn_ratio": _ratio(multi, prompt),
        "cross_program_ratio": _ratio(cross, prompt),
        "loss_pp": 0.0, "loss_multi_turn_pp": 0.0, "loss_cross_program_pp": 0.0,
        "loss_multi_turn_share": None, "evictions": evictions, "truncated_calls": t.truncated,
    }
    if inf is not None:
        lm, lc = (inf.multi - t.multi) * bs, (inf.cross - t.cross) * bs
        row["loss_pp"] = 100.0 * _ratio(lm + lc, prompt)
        row["loss_multi_turn_pp"] = 100.0 * _ratio(lm, prompt)
        row["loss_cross_program_pp"] = 100.0 * _ratio(lc, prompt)
        row["loss_multi_turn_share"] = _ratio(lm, lm + lc) if lm + lc else None
    return row


def apc_table(programs: Sequence[Program], num_blocks_list: Iterable[int], block_size: int = 16,
              strategies: Iterable[str] = STRATEGIES, *, seed: int = 0, decode_tps: float = 0.0,
              profile: dict | None = None, check_integrity: bool = True) -> list[dict]:
    """One row per (cache size, strategy), after a first row for the infinite
    cache (kv_blocks None). All caches replay the calls in lockstep (one pass,
    one token plan per program). Token counts are block-granular (a hit is
    whole blocks). `profile`, when given, is filled with the workload's reuse
    profile (see `reuse_profile`)."""
    sizes = [int(n) for n in num_blocks_list]
    names = list(strategies)
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    for n in sizes:
        if n < 1:
            raise ValueError(f"kv_blocks must be >= 1, got {n}")
    managers = [(n, s, KVCacheManager(n, block_size, eviction=s)) for n in sizes for s in names]
    tallies = [_Tally() for _ in managers]
    inf = _Tally()
    reg = _Registry(block_size)
    plans = _Plans(programs, seed)
    groups = [p.group_id for p in programs]
    order = call_order(programs, decode_tps)
    prompt_total = 0
    # reuse profile: the gap between a program's turns, in other calls; active programs
    pos_last: dict[int, int] = {}
    gaps: list[float] = []
    active: set[int] = set()
    active_counts: list[float] = []
    final_blocks: list[float] = []
    max_call_blocks = 0
    for pos, (now, i, turn) in enumerate(order):
        prompt, output = plans.get(i, turn)
        group = groups[i]
        n_out = max(1, len(output))  # the engine samples at least one token
        space = len(prompt) + n_out
        max_call_blocks = max(max_call_blocks, -(-space // block_size))
        computed = space - 1
        tokens = prompt + output if output else prompt
        prompt_total += len(prompt)
        path = reg.walk(prompt)
        own = [0]  # own[m]: blocks among the first m that this program group computed first
        for node in path:
            own.append(own[-1] + (reg.owner[node] == group))
        inf.count(len(path), own)
        for (n, _, kv), tally in zip(managers, tallies):
            match = kv.match(prompt)
            m = len(match.nodes)
            assert m <= len(path)
            tally.count(m, own)
            cap = n * block_size
            if space > cap:
                tally.truncated += 1
            table = kv.admit(match, min(space, cap) - match.num_tokens, now)
            assert table is not None, "nothing else holds blocks: an admission of at most the cache must fit"
            kv.commit(table, tokens, min(computed, cap))
            kv.free(table, now)
        reg.record(tokens, computed, group)
        # profile
        if turn > 0:
            gaps.append(float(pos - pos_last[i] - 1))
        pos_last[i] = pos
        active.add(i)
        active_counts.append(float(len(active)))
        if turn == len(programs[i].calls) - 1:
            active.discard(i)
            final_blocks.append(float(computed // block_size))
    if check_integrity:
        for _, _, kv in managers:
            kv.check_integrity()
    rows = [_row(None, INFINITE, prompt_total, inf, None, block_size, 0)]
    for (n, s, kv), tally in zip(managers, tallies):
        rows.append(_row(n, s, prompt_total, tally, inf, block_size, kv.pool.num_evictions))
    if profile is not None:
        profile.update(reuse_profile_from(len(programs), len(order), prompt_total, reg.num_blocks,
                                          gaps, active_counts, final_blocks, max_call_blocks))
    return rows


def reuse_profile_from(programs: int, calls: int, prompt_tokens: int, unique_blocks: int,
                       gaps: list[float], active: list[float], final_blocks: list[float],
                       max_call_blocks: int = 0) -> dict:
    """What sizes a cache: program KV (blocks of a program's last context),
    concurrency (programs between their first and last call, seen at each
    call), the inter-turn gap (calls of other programs between two turns of
    one program, the paper's "gap in requests"), and the largest call
    (prompt + output blocks: a smaller cache cannot hold it whole)."""
    p50_blocks = percentile(final_blocks, 50)
    p50_active = percentile(active, 50)
    out = {
        "programs": programs, "calls": calls, "prompt_tokens": prompt_tokens,
        "unique_blocks": unique_blocks, "max_call_blocks": max_call_blocks,
        "program_blocks_p50": p50_blocks, "program_blocks_mean": sum(final_blocks) / len(final_blocks)
        if final_blocks else math.nan,
        "active_programs_p50": p50_active, "active_programs_max": max(active, default=math.nan),
        "inter_turn_gap_p50": percentile(gaps, 50), "inter_turn_gap_p90": percentile(gaps, 90),
        "working_set_blocks": p50_blocks * p50_active,
    }
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}


def reuse_profile(programs: Sequence[Program], block_size: int = 16, *, seed: int = 0,
                  decode_tps: float = 0.0) -> dict:
    """The workload's reuse profile alone (replays no finite cache)."""
    prof: dict = {}
    apc_table(programs, [], block_size, [], seed=seed, decode_tps=decode_tps, profile=prof)
    return prof
