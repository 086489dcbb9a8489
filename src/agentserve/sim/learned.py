"""What the retention policy learned in a simulated run, beside the truth the
workload was generated from: memoryfulness (eta) and the mean duration of
each tool, and how much per-program state the scheduler still holds.

The truth is computed from the programs themselves with the estimators'
own definitions: eta = -Corr(k, N - k) over all programs' (turn, turns left)
pairs (policy/ttl.py's EtaEstimator over every program, not a window), and
each tool's mean as the plain mean of its recorded durations."""

from __future__ import annotations

import math
from collections import defaultdict

from agentserve.policy.ttl import EtaEstimator

NON_TOOLS = frozenset({"human", "unknown"})


def true_values(programs) -> dict:
    """{"eta": float, "tool_means": {tool: seconds}} of a workload's programs."""
    eta = EtaEstimator(window=max(1, len(programs)))
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for p in programs:
        eta.add_program(len(p.calls))
        for c in p.calls[:-1]:
            if c.tool_name and c.tool_name not in NON_TOOLS and math.isfinite(c.tool_duration):
                acc = sums[c.tool_name]
                acc[0] += c.tool_duration
                acc[1] += 1
    return {"eta": eta.value(), "tool_means": {t: s / n for t, (s, n) in sums.items() if n}}


def format_learned(state: dict, truth: dict, label: str) -> str:
    """Lines comparing a run's learned state (SimResult.state) with the truth."""
    lines = [f"{label}: per-program state left: {state.get('programs', 0)} programs, {state.get('pins', 0)} pins, "
             f"{state.get('pending_tools', 0)} pending tool calls, {state.get('eta_programs', 0)} programs in "
             f"the eta window; peak {state.get('peak_running', 0)} running, {state.get('peak_pins', 0)} pins"]
    if state.get("busy_steps"):
        lines.append(f"  scheduler time a step at >= 90% of the peak running ({state['busy_steps']} steps, "
                     f"median {state['busy_pins']:.0f} pins): {state['busy_sched_us']:.0f} us (median)")
    eta = state.get("eta")
    if eta is not None:
        lines.append(f"  eta learned {eta:.3f}, true {truth['eta']:.3f}")
    learned = state.get("tool_means") or {}
    if learned:
        lines.append("  tool mean seconds, learned / true:")
        for tool in sorted(set(learned) | set(truth["tool_means"])):
            lv, tv = learned.get(tool), truth["tool_means"].get(tool)
            lines.append(f"    {tool:<24} {'-' if lv is None else f'{lv:8.2f}'} / {'-' if tv is None else f'{tv:8.2f}'}")
    return "\n".join(lines)
