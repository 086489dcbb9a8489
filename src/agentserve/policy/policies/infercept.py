"""InferCept: per finished turn, preserve, swap or discard its KV, whichever
wastes the least memory-time, with the tool's expected duration taken as
known (InferCept is given it; here it is the tool's running mean).

  preserve: remaining tool time x the request's KV tokens
  discard:  rebuild time x (its own tokens + the running batch's tokens)
  swap:     2 x copy time x the running batch's tokens (needs a host tier)

A preserved request keeps its KV until its next turn arrives (no TTL), but
every step re-weighs preserve against discard with the time that remains, as
InferCept's scheduler does. Waiting requests are FCFS by request arrival."""

from __future__ import annotations

from agentserve.policy.base import Policy, PolicyContext, Retention, register


@register
class InferCept(Policy):
    name = "infercept"

    def __init__(self, ctx: PolicyContext, default_tool_mean: float = 1.0) -> None:
        super().__init__(ctx)
        self.default_tool_mean = default_tool_mean
        self._expected: dict[str, tuple[float, float]] = {}  # program -> (pin start, expected tool seconds)

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
            self._expected[req.program_id] = (now, expected)
            return Retention("pin", float("inf"))
        return Retention("swap") if best == swap else Retention.free()

    def review_pins(self, pins, now):
        drop = []
        batch = self.ctx.running_tokens() if pins else 0
        for pid, pin in pins.items():
            start, expected = self._expected.get(pid, (now, self.default_tool_mean))
            remaining = max(0.0, expected - (now - start))
            preserve, discard, _ = self._waste(pin.num_tokens, remaining, batch)
            if discard < preserve:
                drop.append(pid)
        return drop

    def on_arrival(self, req, program, now):
        super().on_arrival(req, program, now)
        self._expected.pop(req.program_id, None)

    def on_program_end(self, program):
        super().on_program_end(program)
        self._expected.pop(program.program_id, None)
