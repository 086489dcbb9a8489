"""InferCept: per finished turn, preserve, swap or discard its KV, whichever
wastes the least memory-time, with the tool's expected duration taken as
known (InferCept is given it; here it is the tool's running mean).

  preserve: remaining tool time x the request's KV tokens
  discard:  rebuild time x (its own tokens + the running batch's tokens)
  swap:     2 x copy time x the running batch's tokens (needs a host tier)

A preserved request keeps its KV until its next turn arrives, but every step
re-weighs preserve against discard with the time that remains, as InferCept's
scheduler does. Once the tool runs past its expected duration nothing remains
to weigh (preserving looks free), yet the expectation was only an estimate:
the pin's TTL is a deadline of `deadline_factor` x the expected duration, so a
tool that never returns cannot hold memory, or its program, forever. Waiting
requests are FCFS by request arrival."""

from __future__ import annotations

from agentserve.policy.base import Policy, PolicyContext, Retention, register


@register
class InferCept(Policy):
    name = "infercept"

    def __init__(self, ctx: PolicyContext, default_tool_mean: float = 1.0, deadline_factor: float = 2.0) -> None:
        super().__init__(ctx)
        if not deadline_factor >= 1.0:
            raise ValueError(f"deadline_factor must be >= 1 (a pin outlives the expected duration), "
                             f"got {deadline_factor!r}")
        self.default_tool_mean = default_tool_mean
        self.deadline_factor = deadline_factor

    def priority(self, req, program, now):
        return (not req.preempted, req.arrival_time)

    def expected_duration(self, tool: str | None) -> float:
        m = self.tool_stats.mean(tool) if tool is not None else None
        if m is None:
            m = self.tool_stats.global_mean()
        return self.default_tool_mean if m is None else m

    def _waste(self, tokens: int, remaining: float, batch: int) -> tuple[float, float, float]:
        rebuild = self.ctx.reload_cost(tokens)
        preserve = remaining * tokens
        discard = rebuild * (tokens + batch)
        swap = 2.0 * rebuild * batch if self.ctx.host_tier else float("inf")
        return preserve, discard, swap

    def retention(self, req, program, now):
        if req.tool_name is None:
            return Retention.free()
        expected = self.expected_duration(req.tool_name)
        preserve, discard, swap = self._waste(req.num_computed_tokens, expected, self.ctx.running_tokens())
        best = min(preserve, discard, swap)
        if best == preserve:
            return Retention("pin", self.deadline_factor * expected)
        return Retention("swap") if best == swap else Retention.free()

    def review_pins(self, pins, now):
        # The pin's start and tool are its program's last finish and tool: the
        # one program table holds them, so nothing here outlives the program.
        drop = []
        batch = self.ctx.running_tokens() if pins else 0
        programs = self.ctx.programs
        for pid, pin in pins.items():
            prog = programs.get(pid)
            if prog is None or prog.last_finish_time is None:
                continue  # not pinned by a turn of a known program: its expiry governs
            remaining = max(0.0, self.expected_duration(prog.last_tool) - (now - prog.last_finish_time))
            preserve, discard, _ = self._waste(pin.num_tokens, remaining, batch)
            if discard < preserve:
                drop.append(pid)
        return drop
