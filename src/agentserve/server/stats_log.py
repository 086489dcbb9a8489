"""The engine's periodic log line: what the last interval did and where its
time went, so an operator sees throughput, queueing, cache hits and pins
without scraping /metrics."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from agentserve.engine.scheduler_config import p99

if TYPE_CHECKING:
    from agentserve.server.engine_snapshot import EngineSnapshot

STATS_INTERVAL_S = 10.0

log = logging.getLogger("agentserve.server")


class StatsLog:
    """Logs a short `stats_line` between the snapshots taken `interval` seconds
    apart (INFO), and the whole one at DEBUG (`--log-level debug`); the same
    counters are on /metrics and the dashboard."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last: tuple[float, EngineSnapshot] | None = None

    def tick(self, now: float, snapshot: Callable[[], EngineSnapshot]) -> None:
        last = self._last
        if last is None:
            self._last = (now, snapshot())
        elif now - last[0] >= self.interval:
            cur = snapshot()
            line = stats_line(last[1], cur, now - last[0], detail=False)
            if line:
                log.info("engine: %s", line)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("engine details: %s", stats_line(last[1], cur, now - last[0]))
            self._last = (now, cur)


def tool_call_part(prev: EngineSnapshot, cur: EngineSnapshot) -> str | None:
    """The streaming tool-call validators over the interval (None when they did nothing)."""
    a, b = prev.tool_calls, cur.tool_calls
    stops = b.early_stops - a.early_stops
    other = [(n, getattr(b, f) - getattr(a, f)) for n, f in (
        ("undeclared", "undeclared"), ("malformed", "malformed"), ("regenerated", "regenerations"),
        ("fallbacks", "fallbacks"))]
    if not stops and not any(v for _, v in other):
        return None
    grace = b.grace_tokens - a.grace_tokens
    left = b.budget_left - a.budget_left
    text = f"tool calls: {stops} early stops ({grace} grace tokens, {left} max_tokens left)"
    return ", ".join([text] + [f"{v} {n}" for n, v in other if v])


def stats_line(prev: EngineSnapshot, cur: EngineSnapshot, seconds: float, detail: bool = True) -> str | None:
    """One line for the interval from `prev` to `cur`, or None if the model did
    not run (an idle server that only reviews its pins stays quiet). Without
    `detail`: throughput, prefix hits, queue, KV and busy time only."""
    steps = cur.executed_steps - prev.executed_steps
    caches = cache_parts(prev, cur)
    if seconds > 0 and steps <= 0 and caches:  # only cache hits: the model had nothing to do
        return f"{seconds:.0f} s: no model steps; " + "; ".join(caches)
    if steps <= 0 or seconds <= 0:
        return None
    prefill = cur.prefill_tokens - prev.prefill_tokens
    decode = cur.decode_tokens - prev.decode_tokens
    admitted = cur.admitted_prompt_tokens - prev.admitted_prompt_tokens
    hits = cur.hit_tokens - prev.hit_tokens
    busy = cur.execute_s - prev.execute_s
    pinned = cur.num_pinned_blocks / cur.num_blocks if cur.num_blocks else 0.0
    parts = [
        f"{seconds:.0f} s: prompt {prefill / seconds:.0f} tok/s, generation {decode / seconds:.1f} tok/s",
        f"prefix hits {100 * hits / admitted:.0f}% of {admitted} admitted prompt tokens" if admitted else
        "no request admitted",
        f"running {cur.num_running}, waiting {cur.num_waiting}",
        f"KV {100 * cur.kv_usage:.0f}% used, {100 * pinned:.0f}% pinned by {cur.num_pinned_programs} programs",
        f"{steps} steps, model busy {100 * min(busy / seconds, 1.0):.0f}% ({1000 * busy / steps:.1f} ms a step)",
        f"pins +{cur.pins_created - prev.pins_created} hit {cur.pins_hit - prev.pins_hit} "
        f"expired {cur.pins_expired - prev.pins_expired} reclaimed {cur.pins_reclaimed - prev.pins_reclaimed}",
    ]
    if not detail:
        return (f"{seconds:.0f} s: prompt {prefill / seconds:.0f} tok/s, generation {decode / seconds:.1f} tok/s; "
                + (f"prefix hits {100 * hits / admitted:.0f}%; " if admitted else "")
                + f"running {cur.num_running}, waiting {cur.num_waiting}; KV {100 * cur.kv_usage:.0f}% used, "
                f"{100 * pinned:.0f}% pinned; model busy {100 * min(busy / seconds, 1.0):.0f}%")
    with_decodes = cur.decode_steps - prev.decode_steps
    if with_decodes > 0 and cur.recent_decode_step_s:
        times = sorted(cur.recent_decode_step_s[-with_decodes:])
        # an interval's "p99" of fewer than 100 steps is its longest: the engine's recent
        # steps (up to 1024) give one that a lone slow step does not make
        recent = sorted(cur.recent_decode_step_s)
        parts.append(f"longest step with decodes {1000 * times[-1]:.0f} ms, p99 {1000 * p99(times):.0f} ms "
                     f"(prefill capped in {cur.capped_steps - prev.capped_steps} steps), "
                     f"p99 of the last {len(recent)} {1000 * p99(recent):.0f} ms")
    if cur.step_model:
        a, b, c, d, e = cur.step_model
        parts.append(f"step model {1e3 * a:.1f} ms + {1e3 * b:.3f} ms a prompt token + {1e9 * c:.2f} ms per M "
                     f"attention pairs + {1e3 * d:.2f} ms a decode + {1e6 * e:.3f} ms per 1k context, "
                     f"x{cur.step_margin:.2f}")
    tool = tool_call_part(prev, cur)
    if tool:
        parts.append(tool)
    drafted = cur.speculation.draft_tokens - prev.speculation.draft_tokens
    if drafted > 0:
        accepted = cur.speculation.accepted_tokens - prev.speculation.accepted_tokens
        parts.append(f"speculation {accepted}/{drafted} draft tokens accepted ({100 * accepted / drafted:.0f}%), "
                     f"{decode / steps:.2f} tokens a step")
    grouped = cur.grouped_requests - prev.grouped_requests
    if grouped > 0:
        parts.append(f"{grouped} requests waited for a shared prefix's prefill")
    if cur.preemptions > prev.preemptions:
        parts.append(f"preemptions {cur.preemptions - prev.preemptions}")
    return "; ".join(parts + caches)


def cache_parts(prev: EngineSnapshot, cur: EngineSnapshot) -> list[str]:
    """The render/tokenize cache and the response cache over the interval (nothing if idle or off)."""
    parts = []
    r, r0 = cur.render_cache, prev.render_cache
    if r is not None:
        hits, misses, falls = (getattr(r, f) - (getattr(r0, f) if r0 else 0) for f in ("hits", "misses", "fallbacks"))
        reused = r.reused_tokens - (r0.reused_tokens if r0 else 0)
        tokenized = r.tokenized_tokens - (r0.tokenized_tokens if r0 else 0)
        if hits + misses + falls:
            parts.append(f"render cache {hits} hits {misses} misses {falls} fallbacks, "
                         f"{100 * reused / max(reused + tokenized, 1):.0f}% of chat prompt tokens reused")
    c, c0 = cur.response_cache, prev.response_cache
    if c is not None:
        hits, misses = c.hits - (c0.hits if c0 else 0), c.misses - (c0.misses if c0 else 0)
        if hits + misses:
            parts.append(f"response cache {hits} hits {misses} misses, {c.entries} entries")
    return parts
