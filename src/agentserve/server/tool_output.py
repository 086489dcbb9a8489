"""Model text -> OpenAI `tool_calls`, for whole responses and for streams.

Models write tool calls as text: Hermes/Qwen `<tool_call>{json}</tool_call>`
blocks (what the chat template's tools fallback asks SmolLM2 for), or Llama 3's
bare JSON (`{"name": ..., "parameters": ...}` as the whole response). A client
wants structured calls with ids and JSON-string arguments, and finish_reason
"tool_calls".

One state machine does both the streaming and the non-streaming conversion,
so a streamed response always adds up to the non-streamed one:

* plain text is emitted as soon as it cannot be the start of a call;
* once `<tool_call>` appears, the text after it is held back until
  `</tool_call>` closes it; a block that parses to a call of a declared tool
  becomes a tool-call delta, anything else is released as ordinary content;
* a response whose first non-blank text is `{`, `[` or `<|python_tag|>` is held
  whole (Llama 3 JSON calls are recognised only as the entire response) and
  decided at the end;
* trailing whitespace is held until more text follows; whitespace right before
  a call, and at the end of a response that made calls, is dropped (a reply
  that made calls has content without the blank lines around them);
* a call still open when the output was cut (`finish(cut=True)`: max_tokens
  reached) is dropped, as OpenAI drops a call it could not finish: its markup
  is never content.

Calls are validated against the request's tools: an undeclared name, or
arguments that are not a JSON object, leave the text as content."""

from __future__ import annotations

import enum
import json
import secrets
from dataclasses import dataclass, field

from agentserve.policy.toolcalls import ToolCall, parse_tool_calls
from agentserve.server.protocol import FunctionCallOut, ToolCallDelta, ToolCallOut

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_WHOLE_STARTS = ("{", "[", PYTHON_TAG)


class ToolChoiceError(ValueError):
    """`tool_choice` does not fit `tools` (a 400 on param `tool_choice`)."""


@dataclass(frozen=True)
class ToolChoice:
    """What the output parser accepts as a call, from the request's tools and tool_choice."""

    allowed: frozenset[str]  # tool names a call may use
    mode: str  # "auto", "required" or "named"
    parallel: bool = True  # False: keep only the first call
    bare_json: bool = True  # a reply that is all JSON may be Llama 3 calls (False under a JSON response_format)

    @property
    def forced(self) -> bool:
        return self.mode != "auto"


def tool_choice_for(tool_names: list[str], choice: str | None, named: str | None = None,
                    parallel: bool | None = None) -> ToolChoice | None:
    """None when the output should not be parsed for calls (no tools, or
    tool_choice "none"). `choice` is "none", "auto", "required" or None; `named`
    is the function name of a named tool_choice."""
    if not tool_names:
        if named is not None or choice in ("auto", "required"):
            raise ToolChoiceError("tool_choice needs tools: the request declares none")
        return None
    if named is not None:
        if named not in tool_names:
            raise ToolChoiceError(f"tool_choice names function {named!r}, which is not among the tools "
                                  f"({', '.join(tool_names)})")
        return ToolChoice(frozenset([named]), "named", parallel is not False)
    if choice == "none":
        return None
    return ToolChoice(frozenset(tool_names), choice or "auto", parallel is not False)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # a JSON object as a string

    def to_message(self) -> ToolCallOut:
        return ToolCallOut(id=self.id, function=FunctionCallOut(name=self.name, arguments=self.arguments))

    def to_delta(self, index: int) -> ToolCallDelta:
        return ToolCallDelta(index=index, id=self.id,
                             function=FunctionCallOut(name=self.name, arguments=self.arguments))


@dataclass
class OutputDelta:
    """What one piece of model text adds to the reply."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


class _Mode(enum.Enum):
    TEXT = 1
    CALL = 2  # inside <tool_call> ... waiting for </tool_call>
    WHOLE = 3  # the response may be Llama 3 JSON calls: hold it all


class ToolCallStreamer:
    """Feed model text as it arrives; each `feed` returns the content and calls
    that are now certain. `finish` decides whatever is still held."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self.calls: list[ParsedCall] = []
        self._buf = ""
        self._mode = _Mode.TEXT
        self._emitted = False  # any content or call so far
        self._whole_ruled_out = not choice.bare_json  # the response is not Llama 3 JSON calls
        self._ws_before_call = ""  # dropped whitespace, restored if the block is not a call
        self._cut = False

    def feed(self, text: str) -> OutputDelta:
        self._buf += text
        return self._advance(final=False)

    def finish(self, cut: bool = False) -> OutputDelta:
        """Decide what is held. `cut`: the output ended at max_tokens, so an open call is dropped."""
        self._cut = cut
        return self._advance(final=True)

    # --- the machine ---

    def _advance(self, final: bool) -> OutputDelta:
        out = OutputDelta()
        while True:
            if self._mode is _Mode.WHOLE:
                if OPEN in self._buf:  # Hermes blocks after all: handle them as text with calls
                    self._mode = _Mode.TEXT
                    self._whole_ruled_out = True
                    continue
                if final:
                    self._decide_whole(out)
                return out
            if self._mode is _Mode.CALL:
                j = self._buf.find(CLOSE, len(OPEN))
                if j < 0 and not final:
                    return out
                if j < 0 and self._cut:
                    self._buf, self._ws_before_call = "", ""
                    self._mode = _Mode.TEXT
                    return out
                end = len(self._buf) if j < 0 else j + len(CLOSE)
                block, self._buf = self._buf[:end], self._buf[end:]
                self._mode = _Mode.TEXT
                self._decide_block(block, out)
                continue
            if not self._emitted and not self._whole_ruled_out:
                head = self._buf.lstrip()
                if head.startswith(_WHOLE_STARTS):
                    self._mode = _Mode.WHOLE
                    continue
                if not final and (not head or PYTHON_TAG.startswith(head)):
                    return out  # too early to tell
            i = self._buf.find(OPEN)
            if i >= 0:
                before = self._buf[:i]
                text = before.rstrip()
                self._ws_before_call = before[len(text):]
                self._content(text, out)
                self._buf = self._buf[i:]
                self._mode = _Mode.CALL
                continue
            if final:
                rest, self._buf = self._buf, ""
                self._content(rest.rstrip() if self.calls else rest, out)
                return out
            keep = _partial_suffix(self._buf, OPEN)
            safe = self._buf[:len(self._buf) - keep].rstrip()
            self._content(safe, out)
            self._buf = self._buf[len(safe):]
            return out

    def _content(self, text: str, out: OutputDelta) -> None:
        if text:
            out.content += text
            self._emitted = True

    def _decide_block(self, block: str, out: OutputDelta) -> None:
        found = [c for c in parse_tool_calls(block) if c.format == "hermes"]
        calls = self._accept(found) if len(found) == 1 else None
        if calls is None:
            self._content(self._ws_before_call + block, out)
        else:
            self._add(calls, out)
        self._ws_before_call = ""

    def _decide_whole(self, out: OutputDelta) -> None:
        text, self._buf = self._buf, ""
        found = [c for c in parse_tool_calls(text) if c.format == "llama3"]
        calls = self._accept(found) if found else None
        if calls is None:
            self._content(text, out)
        else:
            self._add(calls, out)

    def _accept(self, found: list[ToolCall]) -> list[ParsedCall] | None:
        """All of `found` as calls, or None if any is not a valid call of an allowed tool."""
        calls = []
        for c in found:
            if c.name not in self.choice.allowed or not isinstance(c.arguments, dict):
                return None
            calls.append(ParsedCall(new_call_id(), c.name, json.dumps(c.arguments, ensure_ascii=False)))
        return calls

    def _add(self, calls: list[ParsedCall], out: OutputDelta) -> None:
        self._emitted = True
        for c in calls:
            if self.calls and not self.choice.parallel:
                return  # parallel_tool_calls=false: later calls are dropped
            self.calls.append(c)
            out.calls.append(c)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_tool_output(text: str, choice: ToolChoice | None, cut: bool = False) -> tuple[str | None, list[ParsedCall]]:
    """A finished response as (content, calls). Content is None when the reply
    consists of calls only; without a `choice` the text is returned as is.
    `cut`: the output ended at max_tokens (an open call is dropped)."""
    if choice is None:
        return text, []
    s = ToolCallStreamer(choice)
    a, b = s.feed(text), s.finish(cut)
    content = a.content + b.content
    if s.calls:
        return content or None, s.calls
    return content, []


def finish_reason(engine_reason: str | None, made_calls: bool) -> str | None:
    """"tool_calls" when the reply made calls, else the engine's reason. When
    tool_choice forced a call ("required" or a named function) and the model
    wrote none, the reply is what it wrote and the engine's reason stands:
    forcing the call is the decoder's job, not the parser's."""
    return "tool_calls" if made_calls else engine_reason
