"""The streaming tool-call validator's decisions (toolcall_stream.py mixes them in;
they read and write its state): a closed call judged ok, undeclared or malformed
from its own text; what follows (wait for a parallel call, stop, or back to
prose); a stop only after the server's own parser agrees with it; and the
fallback to plain decoding."""

from __future__ import annotations

import logging

from agentserve.policy.toolcall_scan import POST, SEP, M
from agentserve.policy.toolcalls import ToolCall, parse_tool_calls

log = logging.getLogger("agentserve.toolcalls")


class Verdicts:
    def _count_declared(self, text: str) -> int:
        """The default `verify`: calls of declared tools that policy/toolcalls.py finds."""
        return sum(1 for c in parse_tool_calls(text) if self.declared is None or c.name in self.declared)

    def _judge(self, text: str, fmt: str) -> tuple[str, list[ToolCall]]:
        """ok / undeclared / malformed, for the text of one closed call (or JSON list of calls)."""
        calls = [c for c in parse_tool_calls(text) if c.format == fmt]
        if not calls or (fmt != "llama3" and len(calls) != 1):
            return "malformed", []
        for c in calls:
            if self.declared is not None and c.name not in self.declared:
                return "undeclared", calls
            if fmt != "bash" and not isinstance(c.arguments, dict):
                return "malformed", calls
        return "ok", calls

    def _settle(self, verdict: tuple[str, list[ToolCall]], end: int, closed: bool) -> None:
        """A call ended at `end`: keep waiting, stop, or go back to prose. `closed`: more calls
        may follow it (a hermes block with its </tool_call>, a Llama 3 object)."""
        kind, calls = verdict
        if kind == "ok":
            self.calls.extend(calls)
            self._accepted_end = end
            self._wait_tok = self._accepted_tok = self.tokens - 1
            if self._stats is not None:
                self._stats.add(calls=len(calls))
            if not self.early_stop:
                self._mode, self._carry = M.TEXT, ""
            elif not closed or not self.parallel or self.grace_tokens == 0:
                self._stop("call", end)
            elif self._mode is M.CALL:
                self._mode, self._pending = M.GRACE, ""
            else:
                self._js = POST  # WHOLE: `;` and another object, or the end
            return
        if self._stats is not None:
            self._stats.add(**{kind: 1})
        if self.calls and self.early_stop:
            self._stop("call", self._accepted_end)  # what follows an ok call is not a call: end there
        elif kind == "undeclared" and self.stop_on_undeclared and not self.calls:
            self.rejected_at = (self._call_start, self._token_at(self._call_start))
            self._stop("undeclared", self._call_start)
        elif self._bash and self._mode is M.FENCE_BODY:
            self._mode = M.IDLE  # a second bash block would make the turn a format error anyway
        else:
            self._mode, self._carry = M.TEXT, ""

    def _waiting_idle(self) -> bool:
        """Waiting after a close with no partial opener or closer in progress."""
        m = self._mode
        if m is M.GRACE:
            return not self._pending
        if m is M.WHOLE:
            return self._js in (POST, SEP) and bool(self.calls)
        if m is M.CALL:
            return self._js == POST and self._close_m == 0
        return False

    def _wait_over(self) -> None:
        if self._mode is M.CALL:
            self._json_junk()
        else:
            self._stop("call", self._accepted_end)

    def _stop(self, reason: str, keep: int) -> None:
        if reason == "call":
            expected = len(self.calls) if self.parallel else 1
            try:
                found = self._verify("".join(self._all)[:keep])
            except Exception as e:
                found = f"an error ({e!r})"
            if found != expected:
                self._fallback(f"the output parser finds {found} calls where the validator closed {expected}")
                return
            if self._stats is not None:
                left = max(self.max_tokens - self.tokens, 0) if self.max_tokens else 0
                self._stats.add(early_stops=1, budget_left=left,
                                grace_tokens=max(self.tokens - 1 - self._accepted_tok, 0))
        self.done, self.keep, self.stop_reason = True, keep, reason

    def _fallback(self, reason: str) -> None:
        self.disabled = True
        self.fallback_reason = reason
        log.debug("tool-call validator off for this request: %s", reason)
        if self._stats is not None:
            self._stats.add(fallbacks=1)
