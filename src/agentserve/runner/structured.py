"""Constrained decoding of tool calls (`tool_choice` "required" or a named
function) with xgrammar.

The output is held to exactly one Hermes call, `<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>`, whose name is one of the declared tools (or
the named one) and whose arguments follow that tool's JSON schema; once the
call is closed only an end-of-turn token is allowed. So even a 135M model
returns a valid call when one is required. The grammar is compiled once per
distinct tool set (cached), and each request gets its own matcher, advanced
with every token the request samples."""

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
    """Compiles and caches tool-call grammars for one tokenizer."""

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
        with self._lock:
            return self._constraint(tools, name)

    def _constraint(self, tools: list[dict[str, Any]], name: str | None) -> ToolCallConstraint:
        schema = call_schema(tools, name)
        key = json.dumps(schema, sort_keys=True)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        xgr = _xgr()
        try:
            body = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
            grammar = xgr.Grammar.concat(xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'), body,
                                         xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"'))
            compiled = self._compiler.compile_grammar(grammar)
        except Exception as e:  # xgrammar reports unsupported schema features as plain errors, some only
            # when the grammar compiles (a negative minLength): either way the client's schema is at fault
            raise ValueError(f"a tool's parameters are not a usable JSON schema: {e}") from None
        c = ToolCallConstraint(compiled, key)
        self._cache[key] = c
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return c


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
