"""The streaming tool-call validator's building blocks (policy/toolcall_stream.py): the tags,
a JSON bracket tracker, partial-tag suffixes, the Llama 3 JSON and fenced-block scanners (a mixin
of the validator: they share its state), and the thread-safe counters a server's validators
keep. Pure Python."""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, fields

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
FENCE = "```"
WS = " \t\r\n"
SHELL_LANGS = ("bash", "sh")
FORMATS = ("hermes", "llama3", "bash")


@dataclass(frozen=True)
class ValidatorCounts:
    """Cumulative counters of a server's validators."""

    requests: int = 0  # requests validated
    calls: int = 0  # calls that closed and were ok
    early_stops: int = 0  # requests the validator ended at a call's close
    budget_left: int = 0  # max_tokens left at those stops: an upper bound of the tokens saved
    grace_tokens: int = 0  # tokens decoded after the last call's close before those stops
    undeclared: int = 0  # calls naming a tool the request did not declare (filtered)
    malformed: int = 0  # call blocks that did not parse as a call (left to the parser: text)
    regenerations: int = 0  # undeclared calls re-generated under the tools' grammar
    fallbacks: int = 0  # validators turned off by an inconsistency (the request decoded plainly)


class ValidatorStats:
    """Thread-safe counters: validators count on the engine thread, the server on its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c = {f.name: 0 for f in fields(ValidatorCounts)}

    def add(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._c[k] += v  # KeyError for a misspelt counter: a bug, not data

    def counts(self) -> ValidatorCounts:
        with self._lock:
            return ValidatorCounts(**self._c)


class M(enum.Enum):
    START = 1  # only blank text so far: a Llama 3 JSON response may begin
    TEXT = 2  # prose: watching for an opener
    CALL = 3  # inside <tool_call>
    WHOLE = 4  # a Llama 3 JSON response
    FENCE_INFO = 5  # after ```, reading the info string
    FENCE_BODY = 6  # inside a fenced block
    GRACE = 7  # after an ok hermes call: another call, or the end
    IDLE = 8  # nothing more can be a call the parsers accept: just count tokens


# states of the JSON inside a hermes block, and of a Llama 3 response
PRE, IN, POST, BAD, SEP = range(5)
MORE, CLOSED, MISMATCH = range(3)


class Brackets:
    """Where a JSON value ends, one character at a time: open brackets, strings, escapes."""

    __slots__ = ("stack", "in_str", "esc")

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.in_str = False
        self.esc = False

    def feed(self, c: str) -> int:
        if self.in_str:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
            return MORE
        if c == '"':
            self.in_str = True
        elif c == "{":
            self.stack.append("}")
        elif c == "[":
            self.stack.append("]")
        elif c == "}" or c == "]":
            if not self.stack or self.stack.pop() != c:
                return MISMATCH
            if not self.stack:
                return CLOSED
        return MORE


def partial_suffix(text: str, tags: tuple[str, ...]) -> str:
    """The longest suffix of `text` that is a proper prefix of one of `tags`."""
    for n in range(min(max(len(t) for t in tags) - 1, len(text)), 0, -1):
        tail = text[-n:]
        if any(len(t) > n and t.startswith(tail) for t in tags):
            return tail
    return ""


class OtherForms:
    """The validator's Llama 3 and fenced-block scanners (ToolCallValidator mixes them in; they
    read and write its state and call its `_settle`, `_stop`, `_judge` and `_begin_call`)."""

    # WHOLE: a Llama 3 response, one JSON value or objects chained with `;`
    def _begin_whole(self, start: int) -> None:
        self._mode = M.WHOLE
        self._call_start = start
        self._js = PRE
        self._open_m = 0

    def _whole(self, s: str, i: int) -> int:
        n = len(s)
        seg = i
        while i < n:
            c = s[i]
            i += 1
            if self._hermes:  # a <tool_call> anywhere makes the parser read the response as Hermes blocks
                om = self._open_m
                om = om + 1 if c == OPEN[om] else (1 if c == "<" else 0)
                self._open_m = om
                if om == len(OPEN):
                    if self.calls:
                        self._stop("call", self._accepted_end)
                        return n
                    self._begin_call(self._base + i - len(OPEN))
                    return i
            js = self._js
            if js == IN:
                r = self._json.feed(c)
                if r == MORE:
                    continue
                self._block.append(s[seg:i])
                if r == MISMATCH:
                    self._settle(("malformed", []), self._base + i, closed=True)
                else:
                    self._json_end = self._base + i
                    self._settle(self._judge("".join(self._block), "llama3"), self._json_end, closed=not self._list)
                if self._mode is not M.WHOLE or self.done or self.disabled:
                    return i
                continue
            if c in WS:
                continue
            if js == POST and c == ";":
                self._js = SEP
                self._wait_tok = self.tokens - 1
                continue
            if (js == PRE and c in "{[") or (js == SEP and c == "{"):
                self._list = c == "["
                self._json = Brackets()
                self._json.feed(c)
                self._js = IN
                self._block = [c]
                seg = i
                if js == SEP:
                    self._call_start = self._base + i - 1
                continue
            # anything else: the response is not (or no longer) Llama 3 calls
            if self.calls:
                self._stop("call", self._accepted_end)
                return n
            self._mode, self._carry = M.TEXT, ""
            return i - 1
        if self._js == IN:
            self._block.append(s[seg:])
        return n

    # FENCE_INFO / FENCE_BODY: a fenced block; the first complete bash block is the call
    def _fence_info(self, s: str, i: int) -> int:
        j = s.find("\n", i)
        seg = s[i:] if j < 0 else s[i:j]
        b = seg.find("`")
        if b >= 0:  # inline code such as ```bash```: not an opener (the parser rescans from here)
            self._mode, self._carry = M.TEXT, ""
            return i + b
        self._info.append(seg)
        if j < 0:
            return len(s)
        words = "".join(self._info).split()
        self._lang = words[0].lower() if words else ""
        self._mode, self._carry, self._block = M.FENCE_BODY, "", []
        self._body_start = self._base + j + 1
        return j + 1

    def _fence_body(self, s: str, i: int) -> int:
        carry = self._carry
        buf = carry + s[i:] if carry else s[i:]
        base = self._base + i - len(carry)
        j = buf.find(FENCE)
        if j < 0:
            self._block.append(s[i:])
            self._carry = partial_suffix(buf, (FENCE,))
            return len(s)
        close_start = base + j
        nxt = i + j + len(FENCE) - len(carry)
        self._block.append(s[i:nxt])
        self._carry = ""
        if self._lang not in SHELL_LANGS:
            self._mode = M.TEXT  # another language's block: consumed, as the parser does
            return nxt
        body = "".join(self._block)[:close_start - self._body_start]
        self._call_start = self._body_start
        self._settle(self._judge(f"```bash\n{body}```", "bash"), close_start + len(FENCE), closed=False)
        return nxt
