"""Constrained decoding with xgrammar: tool calls (`tool_choice` "required"
or a named function) and structured outputs (`response_format` json_object
or json_schema).

A forced call is held to exactly one Hermes call, `<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>`, whose name is one of the declared tools (or
the named one) and whose arguments follow that tool's JSON schema; once the
call is closed only an end-of-turn token is allowed. So even a 135M model
returns a valid call when one is required. A structured output is held the
same way to exactly one JSON value (an object for json_object, one following
the schema for json_schema), or, where the request also lets the model call
a tool, to that or one call. A grammar is compiled once per distinct tool set
and format (cached), and each request gets its own matcher, advanced with
every token the request samples."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from agentserve.runner.tokenizer import Tokenizer


class StructuredOutputUnavailable(RuntimeError):
    """xgrammar is not installed."""


class GrammarError(ValueError):
    """A schema the grammar cannot be built from; `param`: whose (the request's "tools" or "response_format")."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# the JSON schema of json_object: any object (xgrammar's non-strict mode lets it have any properties)
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _xgr():
    try:
        import xgrammar
    except ImportError:
        raise StructuredOutputUnavailable(
            "constrained tool calls need xgrammar: pip install 'agentserve[structured]'") from None
    return xgrammar


@dataclass(frozen=True)
class ToolCallConstraint:
    """What a request's sampler must hold its output to (opaque to the engine)."""
    compiled: Any  # xgrammar.CompiledGrammar
    key: str


# xgrammar 0.2 writes one character of a string with minLength/maxLength as [^"\\\r\n] (its issue
# #800): raw control characters, which no JSON parser takes (a tab in a bounded string made the
# reply unparsable), and no escapes. Each is rewritten to one JSON string character (an escape
# counts as one, as maxLength counts); a version that writes it right leaves nothing to rewrite.
# Surrogate code points are left out: xgrammar takes their 3-byte encodings, which are not UTF-8,
# so the text decodes to three U+FFFD where the grammar counted one character (past maxLength).
_BOUNDED_CHAR = r'[^\"\\\r\n]'
_JSON_CHAR = r'(([^\0-\x1f\"\\\uD800-\uDFFF]) | ("\\" ([\"\\/bfnrt] | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))))'


def json_schema_grammar(schema: dict[str, Any], strict: bool = True) -> Any:
    """The grammar of one JSON value following `schema`, compact (no free whitespace, which a
    small model could repeat until max_tokens). `strict`: xgrammar's strict mode (no property
    or item the schema does not declare)."""
    xgr = _xgr()
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=strict)
    text = str(grammar)
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_CHAR, _JSON_CHAR)) if _BOUNDED_CHAR in text else grammar


def call_schema(tools: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
    """JSON schema of one call object: {"name": const, "arguments": parameters}, one branch per tool."""
    branches = []
    for t in tools:
        fn = t.get("function", t)
        if name is not None and fn.get("name") != name:
            continue
        params = fn.get("parameters") or {"type": "object"}
        branches.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                         "required": ["name", "arguments"], "additionalProperties": False})
    if not branches:
        raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


class ToolGrammars:
    """Compiles and caches tool-call and structured-output grammars for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = 64) -> None:
        xgr = _xgr()
        # special tokens (ChatML markers...) must never appear inside a call: an empty
        # entry is one the grammar can never produce; the stop tokens are allowed apart
        specials = set(tokenizer.special_tokens)
        vocab = ["" if (t := tokenizer.id_to_token(i)) is None or t in specials else t
                 for i in range(tokenizer.vocab_size)]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                 stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info)
        self._cache: OrderedDict[str, ToolCallConstraint] = OrderedDict()
        self._cache_size = cache_size
        self.vocab_size = vocab_size
        self._lock = threading.Lock()  # HTTP handler threads compile concurrently

    def constraint(self, tools: list[dict[str, Any]], name: str | None = None) -> ToolCallConstraint:
        schema = call_schema(tools, name)
        return self._cached(json.dumps(schema, sort_keys=True), lambda: self._call_grammar(schema), "tools")

    def json_constraint(self, schema: dict[str, Any] | None, strict: bool = False,
                        tools: list[dict[str, Any]] | None = None) -> ToolCallConstraint:
        """Hold the output to one JSON value following `schema` (None: any JSON object, as
        json_object asks), then end of turn. `strict`: properties and items the schema does not
        declare are left out (OpenAI's strict mode) rather than allowed (JSON Schema's default).
        `tools`: one call of one of them is allowed instead of the JSON (tool_choice "auto")."""
        body, strict = (ANY_OBJECT, False) if schema is None else (schema, strict)
        calls = call_schema(tools, None) if tools else None
        key = "output:" + json.dumps({"json": body, "strict": strict, "or_call": calls}, sort_keys=True)

        def build():
            xgr = _xgr()
            value = self._json_grammar(body, strict)
            return value if calls is None else xgr.Grammar.union(self._call_grammar(calls), value)

        return self._cached(key, build, "response_format" if calls is None else None,
                            lambda: self._compiler.compile_grammar(self._json_grammar(body, strict)))

    def _call_grammar(self, schema: dict[str, Any]) -> Any:
        xgr = _xgr()
        try:
            body = json_schema_grammar(schema)
        except Exception as e:  # xgrammar reports an unsupported schema feature as a plain error
            raise GrammarError(f"a tool's parameters are not a usable JSON schema: {e}", "tools") from None
        return xgr.Grammar.concat(xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'), body,
                                  xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"'))

    @staticmethod
    def _json_grammar(schema: dict[str, Any], strict: bool) -> Any:
        try:
            return json_schema_grammar(schema, strict)
        except Exception as e:
            raise GrammarError(f"response_format's schema is not a usable JSON schema: {e}",
                               "response_format") from None

    def _cached(self, key: str, build, param: str | None, culprit=None) -> ToolCallConstraint:
        """The compiled constraint for `key`, built by `build()` on a miss. A grammar that fails to
        compile is the client's schema's fault (some unsupported features, a negative minLength,
        pass the conversion and fail only here): `param` names whose, or None when `culprit()`
        (compiling the response format's part alone) tells: it fails, or else the tools are at fault."""
        with self._lock:  # HTTP handler threads compile concurrently
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            grammar = build()
            try:
                compiled = self._compiler.compile_grammar(grammar)
            except Exception as e:
                raise self._compile_error(e, param, culprit) from None
            c = ToolCallConstraint(compiled, key)
            self._cache[key] = c
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return c

    @staticmethod
    def _compile_error(e: Exception, param: str | None, culprit) -> GrammarError:
        if param is None:
            try:
                culprit()
                param = "tools"
            except Exception:
                param = "response_format"
        what = "a tool's parameters are" if param == "tools" else "response_format's schema is"
        return GrammarError(f"{what} not a usable JSON schema: {e}", param)


class ConstraintState:
    """Per-request matchers: mask the logits before sampling, advance after."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._matchers: dict[str, Any] = {}

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def mask(self, logits: torch.Tensor, rows: list[int], constraints: list[ToolCallConstraint],
             request_ids: list[str], drafts: list[int | None] | None = None) -> None:
        """Forbid, in place, every token the grammar does not allow next on the
        given rows. A request's consecutive rows verify a draft (drafts[i]: the
        draft token row i's sample is compared with): row i is masked for the
        state after the draft tokens before it, which the matcher takes
        tentatively and gives back. Rows after a draft token the grammar
        refuses stay unmasked: the row before cannot sample that token, so
        they are never kept."""
        xgr = _xgr()
        drafts = drafts if drafts is not None else [None] * len(rows)
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        taken: dict[str, int] = {}  # draft tokens a request's matcher took so far this call
        blocked: set[str] = set()
        for i, (c, rid) in enumerate(zip(constraints, request_ids)):
            m = self._matchers.get(rid)
            if m is None:
                m = self._matchers[rid] = xgr.GrammarMatcher(c.compiled)
            if rid in blocked or m.is_terminated():
                continue  # the row stays unmasked (all ones)
            m.fill_next_token_bitmask(bitmask, i)
            d = drafts[i]
            if d is not None:
                if m.accept_token(d):
                    taken[rid] = taken.get(rid, 0) + 1
                else:
                    blocked.add(rid)
        for rid, n in taken.items():
            self._matchers[rid].rollback(n)
        sub = logits[rows, :self.vocab_size].float().cpu().contiguous()
        xgr.apply_token_bitmask_inplace(sub, bitmask)
        logits[rows, :self.vocab_size] = sub.to(logits.device, logits.dtype)

    def accept(self, request_id: str, token_id: int) -> None:
        m = self._matchers.get(request_id)
        if m is not None and not m.is_terminated():
            m.accept_token(token_id)
