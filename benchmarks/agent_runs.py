"""What the paper's agent workloads are made of (benchmarks/novel_workloads.py
builds them): the six declared tools as OpenAI `tools` JSON schemas, the
system prompts, a run as scripted turns, the assistant message of a call,
and the per-run random stream and tag that keep every run's names unique."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

# ---------------------------------------------------------------------------
# tools


def _tool(name: str, description: str, props: dict[str, dict], required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required}}}


_S = {"type": "string"}
TOOLS: list[dict] = [
    _tool("read_file", "Read a text file of the repository and return its contents.",
          {"path": dict(_S, description="file path relative to the repository root")}, ["path"]),
    _tool("search_code", "Search the repository for a regular expression; returns path:line:text per match.",
          {"query": dict(_S, description="regular expression"),
           "path": dict(_S, description="folder to search (default: the whole repository)")}, ["query"]),
    _tool("write_file", "Write a file of the repository, replacing its contents.",
          {"path": dict(_S, description="file path relative to the repository root"),
           "content": dict(_S, description="the whole new contents")}, ["path", "content"]),
    _tool("run_command", "Run a shell command in the repository root; returns its output and exit code.",
          {"command": dict(_S, description="the command line"),
           "timeout_s": {"type": "integer", "description": "seconds before it is killed"}}, ["command"]),
    _tool("get_diagnostics", "Type-check and lint one file; returns its errors and warnings.",
          {"path": dict(_S, description="file path relative to the repository root")}, ["path"]),
    _tool("summary", "Finish the task: a short summary of what was changed and why.",
          {"text": dict(_S, description="the summary")}, ["text"]),
]
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOLS)

SYSTEM_BUGFIX = (
    "You are a coding agent working in a Python repository. Use the tools to inspect and change the code. "
    "Call exactly one tool per turn and wait for its result. Read the code before changing it, keep changes "
    "minimal, run the tests after every change, check the diagnostics of the files you changed, and finish "
    "with the summary tool once the tests pass.")
SYSTEM_CODING = (
    "You are a senior web developer pairing with the user on a small Flask application. Follow the user's "
    "instructions one step at a time. When a step needs the repository, call exactly one tool and wait for its "
    "result; answer questions in a few sentences without tools. Finish with the summary tool when asked.")


@dataclass(frozen=True)
class ScriptedTurn:
    user: str | None  # a user message appended before this turn's request
    tool: str | None  # the tool the turn is expected to call; None: a prose answer
    call: dict | None  # the expected call's arguments
    result: str | None  # the tool's output, appended after the reply; None: nothing (prose, last turn)


@dataclass(frozen=True)
class AgentRun:
    run_id: str
    workload: str
    system: str
    turns: tuple[ScriptedTurn, ...]
    tools: tuple[dict, ...] = tuple(TOOLS)

    def first_messages(self) -> list[dict]:
        return [{"role": "system", "content": self.system}]


def call_message(tool: str, args: dict, call_id: str) -> dict:
    """The scripted assistant turn: one call of `tool` with `args` (OpenAI format)."""
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function",
         "function": {"name": tool, "arguments": json.dumps(args, ensure_ascii=False)}}]}


def run_rng(workload: str, seed: int, salt: str, index: int) -> random.Random:
    return random.Random(f"{workload}:{seed}:{salt}:{index}")


def run_tag(rng: random.Random) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(6))
