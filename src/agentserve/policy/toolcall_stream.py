"""The streaming tool-call validator (stateful-inference paper, section 3.7).

Fed each decoded piece of a response as it is sampled, it follows the tool-call formats of
policy/toolcalls.py and tells the engine to end the request at the *structural close* of a call,
so the trailing prose a model writes after a call is never decoded:

* ``hermes`` -- ``<tool_call>{json}</tool_call>``: a block ends at the first ``</tool_call>``
  after its opener (where the server's output parser cuts blocks); when the JSON object after the
  opener closes and the model then writes something other than ``</tool_call>`` (or only blank
  text for ``CLOSE_WAIT_TOKENS`` tokens), the block ends where the object closed (the parsers
  accept an unclosed call at the very end of a response);
* ``llama3`` -- a response whose first non-blank text is ``{``, ``[`` or ``<|python_tag|>``: the
  top-level JSON value, followed with a bracket stack that knows strings and escapes; objects
  may be chained with ``;``;
* ``bash`` -- (opt in) the first complete ```` ```bash ```` / ```` ```sh ```` fenced block
  (mini-swe-agent: exactly one block a turn).

Each closed call is parsed from its own text only and judged: *ok* (it names a declared tool and
its arguments are an object), *undeclared* or *malformed*.

**Grace rule (parallel calls).** After an ok call the request does not end at once: a model may
go on with a second call. For hermes the validator waits while the non-blank text after
``</tool_call>`` is a prefix of ``<tool_call>`` (a new call begins: it is followed like the
first) and for at most ``grace_tokens`` tokens of blank text; the first other text, or the end
of the window, ends the request with the text cut right after the last ok call. Llama 3 objects
wait the same way for ``;``. Nothing waits when ``parallel`` is off (``parallel_tool_calls:
false``: the server keeps only the first call), after a JSON list of calls, or after a bash
block (nothing valid can follow them). A model that ends its turn after a call (the usual case)
is ended by its end-of-turn token inside the window, so the window costs nothing then.

**Declared-tool filter.** A call that is not ok never reaches the client: after an ok call the
request ends at that call; before any, the call's text is left to the server's parser, which
returns it as content (finish_reason ``stop``), unless ``stop_on_undeclared`` is set: then an
undeclared call ends the request with the text cut where the call began, and the server
re-generates the call under the tools' grammar (``rejected_at`` says where, in characters and
tokens).

**Safety.** A stop is never a guess: before asking for one the validator runs ``verify`` (the
server's own output parser) on the text it would keep and stops only if that finds exactly the
calls it closed; any disagreement, or any error inside the validator, turns it off for the rest
of the request (plain decoding, counted as a fallback). ``feed`` never raises.

Cost: linear in the text. Prose is scanned with ``str.find`` on each piece plus a carry shorter
than the longest opener; call text is walked once, character by character; each closed call is
parsed once from its own text; the whole text is joined once, at the stop. Pure Python.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable

from agentserve.policy.toolcall_scan import (BAD, CLOSE, CLOSED, FENCE, FORMATS, IN, MISMATCH, OPEN, POST, PRE,
                                             PYTHON_TAG, WS, Brackets, M, OtherForms, ValidatorCounts,
                                             ValidatorStats, partial_suffix)
from agentserve.policy.toolcall_verdicts import Verdicts
from agentserve.policy.toolcalls import ToolCall

__all__ = ["ToolCallValidator", "ValidatorStats", "ValidatorCounts", "GRACE_TOKENS", "CLOSE_WAIT_TOKENS"]

log = logging.getLogger("agentserve.toolcalls")

GRACE_TOKENS = 4  # blank tokens after a call's close that may precede a parallel call
CLOSE_WAIT_TOKENS = 4  # blank tokens after a hermes call's JSON that may precede </tool_call>


class ToolCallValidator(Verdicts, OtherForms):
    """One request's validator. The engine calls `feed(piece)` once per output token (the
    token's decoded text, possibly empty; not for end-of-turn tokens); True means: end the
    request now with the text cut to `keep` characters. `hold` is how many characters at the
    end of the text a later stop may still cut (the engine does not stream them yet).

    `declared`: the tool names a call may use (None: any, for bash blocks). `formats`: which of
    hermes, llama3, bash to follow. `early_stop`: end the request at an ok call's close (off:
    only `stop_on_undeclared` can end it). `verify(text)`: how many calls the server's parser
    finds in `text` (default: the declared calls policy/toolcalls.py's parser finds)."""

    def __init__(self, declared: Iterable[str] | None = None, *, formats: Iterable[str] = ("hermes", "llama3"),
                 parallel: bool = True, grace_tokens: int = GRACE_TOKENS, early_stop: bool = True,
                 stop_on_undeclared: bool = False, max_tokens: int | None = None,
                 verify: Callable[[str], int] | None = None, stats: ValidatorStats | None = None) -> None:
        formats = tuple(formats)
        bad = [f for f in formats if f not in FORMATS]
        if bad:
            raise ValueError(f"unknown tool-call format {bad[0]!r} (known: {', '.join(FORMATS)})")
        if grace_tokens < 0:
            raise ValueError(f"grace_tokens must be >= 0, got {grace_tokens}")
        self.declared = None if declared is None else frozenset(declared)
        self.parallel = parallel
        self.grace_tokens = grace_tokens
        self.early_stop = early_stop
        self.stop_on_undeclared = stop_on_undeclared
        self.max_tokens = max_tokens
        self._verify = verify or self._count_declared
        self._stats = stats
        self._hermes, self._llama3, self._bash = ("hermes" in formats, "llama3" in formats, "bash" in formats)
        self._openers = tuple(t for t, on in ((OPEN, self._hermes), (FENCE, self._bash)) if on)
        # results
        self.calls: list[ToolCall] = []  # ok calls, in order
        self.done = False  # feed asked for the stop
        self.disabled = False  # fell back to plain decoding
        self.keep = 0  # characters kept at the stop
        self.stop_reason: str | None = None  # "call" or "undeclared"
        self.rejected_at: tuple[int, int] | None = None  # (character, token) where the undeclared call began
        self.fallback_reason: str | None = None
        self.tokens = 0  # pieces fed
        # position
        self._end = 0  # characters fed
        self._base = 0  # characters before the piece being fed
        self._all: list[str] = []  # every piece, joined once at a stop
        self._starts: list[int] = []  # first character of each non-empty piece
        self._start_toks: list[int] = []  # and its token
        # state
        self._mode = M.START if self._llama3 else M.TEXT
        self._carry = ""  # TEXT / FENCE_BODY: held text that may begin an opener or a fence
        self._head = ""  # START: a partial <|python_tag|>
        self._head_start = 0
        self._call_start = 0  # where the call being followed began
        self._block: list[str] = []  # its text so far
        self._json = Brackets()
        self._js = PRE  # its JSON's state
        self._close_m = 0  # characters of </tool_call> matched
        self._json_end = 0
        self._verdict: tuple[str, list[ToolCall]] | None = None
        self._wait_tok = 0  # the token whose piece closed what is waited after
        self._accepted_end = 0  # where the last ok call ended
        self._accepted_tok = 0  # the token whose piece ended it
        self._list = False  # the Llama 3 response is a JSON list
        self._pending = ""  # GRACE: non-blank text after </tool_call>, a prefix of <tool_call>
        self._lang = ""
        self._open_m = 0  # WHOLE: characters of <tool_call> matched
        self._info: list[str] = []
        self._body_start = 0
        self._formats = formats

    # --- the engine's side ---

    def feed(self, piece: str) -> bool:
        if self.done or self.disabled:
            self.tokens += 1
            return False
        try:
            return self._feed(piece)
        except Exception as e:  # a validator bug must never change the output
            log.warning("tool-call validator failed (%r); the request decodes plainly", e)
            self._fallback(f"internal error: {e!r}")
            return False

    @property
    def hold(self) -> int:
        if self.done or self.disabled or self._mode is M.IDLE:
            return 0
        if self.calls and self.early_stop:
            return self._end - self._accepted_end
        m = self._mode
        if m is M.TEXT or m is M.FENCE_BODY:
            return len(self._carry)
        if m is M.FENCE_INFO:
            return 0
        if m is M.START:
            return self._end
        return self._end - self._call_start  # inside a call: a stop may cut where it began

    @property
    def cache_key(self) -> str:
        """Everything besides the text that decides where this validator stops (for a cache of
        responses keyed by what decides the output)."""
        names = None if self.declared is None else sorted(self.declared)
        return repr((names, self._formats, self.parallel, self.grace_tokens, self.early_stop,
                     self.stop_on_undeclared))

    def fail(self, reason: str) -> None:
        """The engine found the validator's answer inconsistent: stop validating, count it."""
        if not self.disabled:
            self._fallback(reason)

    # --- the machine ---

    def _feed(self, piece: str) -> bool:
        tok = self.tokens
        self.tokens += 1
        if tok == 0 and self._stats is not None:
            self._stats.add(requests=1)  # counted when it first sees output (not for a cached reply)
        self._base = self._end
        if piece:
            self._starts.append(self._end)
            self._start_toks.append(tok)
            self._all.append(piece)
        i, n = 0, len(piece)
        while i < n and not (self.done or self.disabled) and self._mode is not M.IDLE:
            i = self._HANDLERS[self._mode](self, piece, i)
        self._end = self._base + n
        if not (self.done or self.disabled) and self._waiting_idle():
            limit = CLOSE_WAIT_TOKENS if self._mode is M.CALL else self.grace_tokens
            if tok - self._wait_tok >= limit:
                self._wait_over()
        return self.done

    def _token_at(self, pos: int) -> int:
        """The token whose piece holds character `pos`."""
        k = bisect.bisect_right(self._starts, pos) - 1
        return self._start_toks[max(k, 0)] if self._starts else 0

    # START: blank text, then `{`/`[`/<|python_tag|> (Llama 3 JSON) or anything else (TEXT)
    def _start(self, s: str, i: int) -> int:
        n = len(s)
        while i < n:
            c = s[i]
            if self._head:
                h = self._head + c
                if PYTHON_TAG.startswith(h):
                    self._head = h
                    i += 1
                    if h == PYTHON_TAG:
                        self._begin_whole(self._head_start)
                        return i
                    continue
                self._carry, self._head = self._head, ""  # it may still begin <tool_call>
                self._mode = M.TEXT
                return i
            if c in WS:
                i += 1
            elif c == "{" or c == "[":
                self._begin_whole(self._base + i)
                return i
            elif c == "<":
                self._head, self._head_start = "<", self._base + i
                i += 1
            else:
                self._mode = M.TEXT
                return i
        return n

    # TEXT: find the next opener
    def _text(self, s: str, i: int) -> int:
        carry = self._carry
        buf = carry + s[i:] if carry else s[i:]
        base = self._base + i - len(carry)
        j = buf.find(OPEN) if self._hermes else -1
        f = buf.find(FENCE) if self._bash else -1
        if j < 0 and f < 0:
            self._carry = partial_suffix(buf, self._openers) if self._openers else ""
            return len(s)
        self._carry = ""
        if f < 0 or 0 <= j < f:
            self._begin_call(base + j)
            return i + j + len(OPEN) - len(carry)
        self._mode, self._info = M.FENCE_INFO, []
        return i + f + len(FENCE) - len(carry)

    # CALL: inside <tool_call>, until the first </tool_call> (as the server's parser cuts it)
    def _begin_call(self, start: int) -> None:
        self._mode = M.CALL
        self._call_start = start
        self._block = [OPEN]
        self._json = Brackets()
        self._js = PRE
        self._close_m = 0
        self._verdict = None

    def _call(self, s: str, i: int) -> int:
        n, seg, m, js, br = len(s), i, self._close_m, self._js, self._json
        while i < n:
            c = s[i]
            i += 1
            if c == CLOSE[m]:
                m += 1
                if m == len(CLOSE):
                    self._block.append(s[seg:i])
                    self._close_m, self._js = 0, js
                    self._settle(self._judge("".join(self._block), "hermes"), self._base + i, closed=True)
                    return i
            else:
                m = 1 if c == "<" else 0
            if js == PRE:
                if c in WS:
                    continue
                if c == "{":
                    br.feed(c)
                    js = IN
                else:
                    js = BAD
            elif js == IN:
                r = br.feed(c)
                if r == CLOSED:
                    self._block.append(s[seg:i])
                    seg = i
                    js = POST
                    self._json_end = self._base + i
                    self._verdict = self._judge("".join(self._block), "hermes")
                    self._wait_tok = self.tokens - 1
                    if self._settles_now(self._verdict[0]):
                        self._close_m, self._js = m, js  # nothing to wait for: settle now
                        self._settle(self._verdict, self._json_end, closed=False)
                        if self._mode is not M.CALL or self.done or self.disabled:
                            return i
                elif r == MISMATCH:
                    js = BAD
            elif js == POST and c not in WS and m == 0:
                # text other than </tool_call> after the object: the call ends where it closed
                self._close_m, self._js = m, js
                self._json_junk()
                if self._mode is not M.CALL or self.done or self.disabled:
                    return i
                js = self._js
        self._block.append(s[seg:])
        self._close_m, self._js = m, js
        return n

    def _settles_now(self, kind: str) -> bool:
        """A call that is not ok settles when its JSON closes if that ends the request (after an
        ok call, or an undeclared one to re-generate); else at </tool_call>, where the server's
        parser ends the block."""
        if kind == "ok":
            return False
        if self.calls:
            return self.early_stop
        return kind == "undeclared" and self.stop_on_undeclared

    def _json_junk(self) -> None:
        verdict = self._verdict or ("malformed", [])
        if verdict[0] == "ok" and self.early_stop:
            self._settle(verdict, self._json_end, closed=False)
            return
        self._js = BAD  # the block is judged whole when </tool_call> comes, as the parser judges it

    # GRACE: after an ok hermes call: blank text, then another <tool_call> or the end
    def _grace(self, s: str, i: int) -> int:
        n = len(s)
        while i < n:
            c = s[i]
            i += 1
            if not self._pending and c in WS:
                continue
            p = self._pending + c
            if not OPEN.startswith(p):
                self._stop("call", self._accepted_end)
                return n
            self._pending = p
            if p == OPEN:
                self._pending = ""
                self._begin_call(self._base + i - len(OPEN))
                return i
        return n

    _HANDLERS = {M.START: _start, M.TEXT: _text, M.CALL: _call, M.WHOLE: OtherForms._whole,
                 M.FENCE_INFO: OtherForms._fence_info, M.FENCE_BODY: OtherForms._fence_body, M.GRACE: _grace}
