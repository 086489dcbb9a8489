"""The JSONL trace format: `save_jsonl` and `load_jsonl`, the latter checking
every field (trace.py says what the token counts mean).

JSONL line keys (one object per line):

    program_id, turn, arrival, prompt_tokens, new_tokens, output_tokens,
    tool_name, tool_duration                       -- required on every line
    hash_ids, hash_block_size, shared_prefix_tokens,
    message_index                                  -- optional, per call
    messages, parent_id, parent_turn, prefix_tokens -- optional, per program,
                                                      on the program's turn-0 line

Optional keys are written only when they differ from their defaults, so a
trace written by `save_jsonl` and read back by `load_jsonl` compares equal.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable

from .trace import Program, TraceCall


class TraceError(ValueError):
    """A malformed trace; the message names the line (1-based) and the field."""


# ---------------------------------------------------------------------------
# JSONL

_REQUIRED = (
    ("program_id", str),
    ("turn", int),
    ("arrival", float),
    ("prompt_tokens", int),
    ("new_tokens", int),
    ("output_tokens", int),
    ("tool_name", str),  # or None
    ("tool_duration", float),
)
_NON_NEGATIVE = ("turn", "arrival", "prompt_tokens", "new_tokens", "output_tokens", "tool_duration")


def _err(lineno: int, fieldname: str, msg: str) -> TraceError:
    return TraceError(f"line {lineno}: field '{fieldname}': {msg}")


def _check_type(lineno: int, name: str, value: Any, kind: type) -> None:
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok:
            raise _err(lineno, name, f"expected a finite number, got {value!r}")
    elif kind is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _err(lineno, name, f"expected an integer, got {value!r}")
    elif kind is str:
        if not isinstance(value, str):
            raise _err(lineno, name, f"expected a string, got {value!r}")


def _call_from_obj(obj: Any, lineno: int) -> TraceCall:
    if not isinstance(obj, dict):
        raise TraceError(f"line {lineno}: expected a JSON object, got {type(obj).__name__}")
    for name, kind in _REQUIRED:
        if name not in obj:
            raise _err(lineno, name, "missing")
        value = obj[name]
        if name == "tool_name" and value is None:
            continue
        _check_type(lineno, name, value, kind)
    for name in _NON_NEGATIVE:
        if obj[name] < 0:
            raise _err(lineno, name, f"negative value {obj[name]!r}")
    if obj["new_tokens"] > obj["prompt_tokens"]:
        raise _err(lineno, "new_tokens", f"{obj['new_tokens']} > prompt_tokens {obj['prompt_tokens']}")
    if obj["prompt_tokens"] < 1:
        raise _err(lineno, "prompt_tokens", "a call needs at least one prompt token")
    kwargs: dict[str, Any] = {name: obj[name] for name, _ in _REQUIRED}
    kwargs["arrival"] = obj["arrival"] if isinstance(obj["arrival"], float) else float(obj["arrival"])
    kwargs["tool_duration"] = (
        obj["tool_duration"] if isinstance(obj["tool_duration"], float) else float(obj["tool_duration"])
    )
    bs = obj.get("hash_block_size", 64)
    _check_type(lineno, "hash_block_size", bs, int)
    if bs < 1:
        raise _err(lineno, "hash_block_size", f"must be >= 1, got {bs}")
    kwargs["hash_block_size"] = bs
    hids = obj.get("hash_ids")
    if hids is not None:
        if not isinstance(hids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hids):
            raise _err(lineno, "hash_ids", "expected a list of integers")
        if len(hids) != obj["prompt_tokens"] // bs:
            raise _err(
                lineno, "hash_ids",
                f"{len(hids)} ids but prompt_tokens // hash_block_size = {obj['prompt_tokens'] // bs}",
            )
        kwargs["hash_ids"] = hids
    spt = obj.get("shared_prefix_tokens", 0)
    _check_type(lineno, "shared_prefix_tokens", spt, int)
    if spt < 0:
        raise _err(lineno, "shared_prefix_tokens", f"negative value {spt}")
    if spt > obj["prompt_tokens"]:
        raise _err(lineno, "shared_prefix_tokens", f"{spt} > prompt_tokens {obj['prompt_tokens']}")
    kwargs["shared_prefix_tokens"] = spt
    mi = obj.get("message_index")
    if mi is not None:
        _check_type(lineno, "message_index", mi, int)
        kwargs["message_index"] = mi
    return TraceCall(**kwargs)


def _call_to_obj(c: TraceCall) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "program_id": c.program_id,
        "turn": c.turn,
        "arrival": c.arrival,
        "prompt_tokens": c.prompt_tokens,
        "new_tokens": c.new_tokens,
        "output_tokens": c.output_tokens,
        "tool_name": c.tool_name,
        "tool_duration": c.tool_duration,
    }
    if c.hash_ids is not None:
        obj["hash_ids"] = c.hash_ids
    if c.hash_block_size != 64:
        obj["hash_block_size"] = c.hash_block_size
    if c.shared_prefix_tokens:
        obj["shared_prefix_tokens"] = c.shared_prefix_tokens
    if c.message_index is not None:
        obj["message_index"] = c.message_index
    return obj


def save_jsonl(programs: Iterable[Program], path: str | os.PathLike) -> None:
    """Write one TraceCall a line, program by program in the given order.
    Program-level optional fields go on the program's turn-0 line."""
    with open(path, "w", encoding="utf-8") as f:
        for p in programs:
            for c in p.calls:
                if c.program_id != p.program_id:
                    raise TraceError(f"program {p.program_id!r}: call {c.turn} has program_id {c.program_id!r}")
                obj = _call_to_obj(c)
                if c.turn == 0:
                    if p.messages is not None:
                        obj["messages"] = p.messages
                    if p.parent_id is not None:
                        obj["parent_id"] = p.parent_id
                    if p.parent_turn is not None:
                        obj["parent_turn"] = p.parent_turn
                    if p.prefix_tokens:
                        obj["prefix_tokens"] = p.prefix_tokens
                f.write(json.dumps(obj, ensure_ascii=False))
                f.write("\n")


def load_jsonl(path: str | os.PathLike) -> list[Program]:
    """Read a JSONL trace; programs sorted by turn-0 arrival (stable), calls by turn.

    Raises TraceError (a ValueError) with the line number and field on: bad JSON,
    a missing/ill-typed/negative field, new_tokens > prompt_tokens, a duplicate
    turn, turns that are not 0..n-1, and a reused prefix (prompt - new) longer
    than the previous call's prompt + output."""
    calls: dict[str, list[tuple[int, TraceCall, dict]]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"line {lineno}: invalid JSON: {e.msg}") from None
            c = _call_from_obj(obj, lineno)
            extra = {k: obj[k] for k in ("messages", "parent_id", "parent_turn", "prefix_tokens") if k in obj}
            calls.setdefault(c.program_id, []).append((lineno, c, extra))
    programs: list[Program] = []
    for pid, rows in calls.items():
        rows.sort(key=lambda r: r[1].turn)
        seen: dict[int, int] = {}
        for lineno, c, _ in rows:
            if c.turn in seen:
                raise _err(lineno, "turn", f"program {pid!r} has turn {c.turn} twice (also line {seen[c.turn]})")
            seen[c.turn] = lineno
        for i, (lineno, c, _) in enumerate(rows):
            if c.turn != i:
                raise _err(lineno, "turn", f"program {pid!r}: turns are not contiguous 0..n-1 (turn {i} missing)")
        p = Program(pid, [r[1] for r in rows])
        for lineno, c, extra in rows:
            if extra and c.turn != 0:
                raise _err(lineno, next(iter(extra)), "program-level field allowed on the turn-0 line only")
            if "messages" in extra:
                if extra["messages"] is not None and not isinstance(extra["messages"], list):
                    raise _err(lineno, "messages", "expected a list")
                p.messages = extra["messages"]
            if "parent_id" in extra:
                if extra["parent_id"] is not None:
                    _check_type(lineno, "parent_id", extra["parent_id"], str)
                p.parent_id = extra["parent_id"]
            if "parent_turn" in extra:
                if extra["parent_turn"] is not None:
                    _check_type(lineno, "parent_turn", extra["parent_turn"], int)
                p.parent_turn = extra["parent_turn"]
            if "prefix_tokens" in extra:
                _check_type(lineno, "prefix_tokens", extra["prefix_tokens"], int)
                if not 0 <= extra["prefix_tokens"] <= c.prompt_tokens:
                    raise _err(lineno, "prefix_tokens", "expected 0 <= prefix_tokens <= prompt_tokens")
                p.prefix_tokens = extra["prefix_tokens"]
        for (_, prev, _), (lineno, c, _) in zip(rows, rows[1:]):
            reused = c.prompt_tokens - c.new_tokens
            if reused > prev.prompt_tokens + prev.output_tokens:
                raise _err(
                    lineno, "new_tokens",
                    f"reused prefix prompt-new = {reused} exceeds previous prompt+output "
                    f"{prev.prompt_tokens + prev.output_tokens}",
                )
        programs.append(p)
    programs.sort(key=lambda p: p.arrival)
    return programs


# ---------------------------------------------------------------------------
# statistics
