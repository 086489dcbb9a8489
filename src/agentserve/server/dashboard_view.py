"""What /dashboard/state answers, built on the engine thread (a command, so no
step changes what it reads): programs with their recent turns, the KV pool by
state, the pins with the time they have left, and the policy's recent TTL
decisions with their inputs.

Times are seconds relative to the engine's clock now (negative: in the past),
so the page needs no clock of the server's.

On a server with several tenants (tenants.py), where the engine's program ids
are `tenant/id` (identity.py), a caller sees only their tenant's programs
(their ids as the client sent them), turns, pins and decisions, and of the KV
pool only the blocks their own requests and pins hold: the rest is one
number, "other", so nothing of other tenants' traffic or caching shows
(requests without a program id are nobody's and show to no tenant). With one
tenant or none there is nobody to hide from, and the caller sees everything."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from agentserve.policy.decision_log import Decision
from agentserve.server.program_timeline import ProgramTimeline, Turn

@dataclass
class DashboardSource:
    """What the dashboard reads besides the scheduler: the timeline the engine feeds."""

    timeline: ProgramTimeline = field(default_factory=ProgramTimeline)


def _r(t: float | None, now: float) -> float | None:
    return None if t is None else round(t - now, 3)


def _num(x: float | None) -> float | None:
    """A float JSON can carry (None for NaN and infinities), to 4 significant digits."""
    return None if x is None or not math.isfinite(x) else float(f"{x:.4g}")


def _turn(t: Turn, now: float, decision: Decision | None) -> dict:  # (a request id is the server's: shown as is)
    d = {"id": t.request_id, "arrival": _r(t.arrival, now), "admitted": _r(t.admitted, now),
         "first_token": _r(t.first_token, now), "end": _r(t.end, now), "outcome": t.outcome,
         "prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens, "output_tokens": t.output_tokens}
    if decision is not None:  # what followed the turn: its tool, and what the policy kept for it
        d.update(tool=decision.tool, action=decision.action, ttl=_num(decision.ttl))
    return d


def _decision(d: Decision, now: float, show) -> dict:
    out = {"time": _r(d.time, now), "program_id": show(d.program_id), "request_id": d.request_id, "tool": d.tool,
           "action": d.action, "ttl": _num(d.ttl), "tool_mean_s": _num(d.tool_mean_s),
           "tool_samples": d.tool_samples}
    i = d.inputs
    if i is not None:
        out.update(regime=i.regime, eta=_num(i.eta), queue_delay_s=_num(i.queue_delay_s),
                   reload_s=_num(i.reload_s), benefit_s=_num(i.benefit_s), mean_used_s=_num(i.mean_used_s),
                   capped=i.capped, pin_cost=_num(i.pin_cost), reload_from=i.source)
    return out


def _kv_all(kv: Any) -> dict:
    free = kv.num_free_blocks
    cached = kv.pool.num_cached_free  # free, but still holding an indexed prefix
    pinned = kv.num_pinned_blocks
    held = kv.num_blocks - free
    host = {"used": kv.host.num_used, "slots": kv.host.num_slots} if kv.host.enabled else None
    # every pinned block is held (the pin's reference); a block a pin and a request share counts as pinned
    return {"states": {"running": held - pinned, "pinned": pinned, "cached": cached, "free": free - cached},
            "host": host}


def _kv_own(kv: Any, running: list[Any], pins: dict[str, Any]) -> dict:
    pinned = {b.block_id for p in pins.values() for b in p.blocks}
    held: set[int] = set()
    for req in running:
        table = req.block_table  # (kv/block_table.py: on the request while it runs)
        if table is not None and not table.released:
            held.update(b.block_id for b in table.blocks)
    held -= pinned
    return {"states": {"running": len(held), "pinned": len(pinned),
                       "other": kv.num_blocks - len(held) - len(pinned)}, "host": None}


def _state(track_turns: list[Turn], pid: str, pins: dict[str, Any], live: Any) -> str:
    for t in reversed(track_turns):
        if t.open:
            return t.outcome  # "waiting" or "running"
    if pid in pins:
        return "pinned"
    return "tool" if pid in live else "ended"


def build_state(scheduler: Any, source: DashboardSource, now: float, scope: str | None, tenant: str | None = None,
                integrity_failures: int = 0) -> dict:
    """The dashboard's JSON for a caller whose programs are scoped by `scope` (None:
    everything); `tenant` is the caller's tenant, for the page to name. On the engine thread."""
    timeline = source.timeline
    timeline.observe(itertools.chain(scheduler.waiting, scheduler.running), now)
    if scope is None:
        def mine(pid: str) -> bool:
            return True

        def show(pid: str) -> str:
            return pid
    else:
        prefix = scope + "/"  # identity.scoped_program_id

        def mine(pid: str) -> bool:
            return pid.startswith(prefix)

        def show(pid: str) -> str:
            return pid[len(prefix):]
    kv = scheduler.kv
    pins = {pid: p for pid, p in kv.pins.items() if mine(pid)}
    decisions = [d for d in scheduler.policy.decisions.recent() if mine(d.program_id)]
    by_request = {d.request_id: d for d in decisions}
    programs = []
    for track in timeline.programs():
        if not mine(track.program_id):
            continue
        turns = list(track.turns)
        pin = pins.get(track.program_id)
        programs.append({
            "id": show(track.program_id), "state": _state(turns, track.program_id, pins, scheduler.programs),
            "first_arrival": _r(track.first_arrival, now),
            "turns": [_turn(t, now, by_request.get(t.request_id)) for t in turns],
            "pin": None if pin is None else {"ttl_left": round(pin.expiry - now, 3), "blocks": len(pin.blocks),
                                             "tokens": pin.num_tokens}})
    one_shot = [_turn(t, now, None) for t in timeline.one_shot if mine(t.program_id)]
    running = [r for r in scheduler.running if mine(r.program_id)]
    waiting = [r for r in scheduler.waiting if mine(r.program_id)]
    kv_view = _kv_all(kv) if scope is None else _kv_own(kv, running, pins)
    kv_view.update(num_blocks=kv.num_blocks, block_size=kv.block_size)
    state = {
        "tenant": tenant, "scoped": scope is not None, "policy": scheduler.policy.name, "kv": kv_view,
        "pins": sorted(({"program_id": show(pid), "ttl_left": round(p.expiry - now, 3), "blocks": len(p.blocks),
                         "tokens": p.num_tokens} for pid, p in pins.items()), key=lambda p: p["ttl_left"]),
        "programs": programs, "one_shot": one_shot,
        "decisions": [_decision(d, now, show) for d in reversed(decisions)],  # newest first
        "requests": {"running": len(running), "waiting": len(waiting)},
    }
    if scope is None:  # server-wide figures: only where nobody is to be hidden from
        s = scheduler.stats
        state["counters"] = {"pins_created": s.pins_created, "pins_hit": s.pins_hit, "pins_expired": s.pins_expired,
                             "pins_reclaimed": s.pins_reclaimed, "decisions": scheduler.policy.decisions.total,
                             "kv_integrity_failures": integrity_failures}
        if scheduler.kv.host.enabled:  # reloads before predicted returns (engine/prefetch.py)
            state["counters"].update(prefetch_issued=s.prefetch_issued, prefetch_used=s.prefetch_used,
                                     prefetch_late=s.prefetch_late, prefetch_wasted=s.prefetch_wasted)
    return state
