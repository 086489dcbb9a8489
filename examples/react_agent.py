"""A small ReAct agent against `agentserve serve`, through the official `openai` client.

    agentserve serve                                   # SmolLM2-135M-Instruct on 127.0.0.1:8000
    python examples/react_agent.py "What is 17 * 23 + 4?"

The agent alternates LLM calls with local tool calls (safe arithmetic, reading
a file, listing a folder) until the model answers without calling a tool. All
calls of one task carry the same `X-Program-Id`, so the server sees one
program: it keeps the conversation's KV through the tool calls, and each turn
prefills only what the previous turn did not already compute. The line printed
per turn shows it: prompt tokens, how many of them were prefix-cache hits, and
the latency. When the task is done the program is ended explicitly, so the
server drops its pin at once instead of waiting for the TTL.

Small models call tools far more reliably after a few worked examples (the
ReAct paper's prompts are few-shot too), so the conversation starts with
three demonstrations, one per tool; --no-demos leaves them out. They are the
same for every task, so after the first task they are prefix-cache hits too.

File tools only see the folder given by --root (default: the current one)."""

from __future__ import annotations

import argparse
import ast
import json
import operator
import sys
import time
import uuid
from pathlib import Path

import httpx
from openai import OpenAI

SYSTEM = ("You are a careful assistant. Use a tool when it helps: `calculate` for arithmetic, `list_dir` "
          "and `read_file` for files. When you know the answer, reply with it in one short sentence.")

TOOLS = [
    {"type": "function", "function": {
        "name": "calculate", "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file (the first 2000 characters).",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "list_dir", "description": "List the entries of a folder.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
]


def _demo(i: int, question: str, tool: str, args: dict, result: str, answer: str) -> list[dict]:
    call_id = f"call_demo{i}"
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": tool, "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": call_id, "content": result},
            {"role": "assistant", "content": answer}]


DEMOS = (_demo(1, "What is 365 * 24?", "calculate", {"expression": "365 * 24"}, "8760", "365 * 24 = 8760.")
         + _demo(2, "Which files are in the folder docs?", "list_dir", {"path": "docs"}, "intro.md\nusage.md",
                 "The folder docs holds intro.md and usage.md.")
         + _demo(3, "What is the title of docs/intro.md?", "read_file", {"path": "docs/intro.md"},
                 "# Getting started\n\nInstall the package, then run it.", 'Its title is "Getting started".'))

# --- tools -----------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """Arithmetic only: the expression is parsed, never eval'd, and only numbers
    and arithmetic operators are accepted (no names, calls or attributes)."""

    def ev(node: ast.AST) -> float | int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _BINARY[type(node.op)](left, right)
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    if len(expression) > 200:
        return "error: expression too long"
    try:
        return str(ev(ast.parse(expression, mode="eval")))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as e:
        return f"error: {e}"


def _inside(root: Path, path: str) -> Path:
    p = (root / path).resolve()
    if p != root and root not in p.parents:
        raise ValueError(f"{path} is outside {root}")
    return p


def read_file(root: Path, path: str) -> str:
    try:
        return _inside(root, path).read_text(errors="replace")[:2000]
    except (OSError, ValueError) as e:
        return f"error: {e}"


def list_dir(root: Path, path: str = ".") -> str:
    try:
        p = _inside(root, path)
        return "\n".join(sorted(e.name + ("/" if e.is_dir() else "") for e in p.iterdir())[:100])
    except (OSError, ValueError) as e:
        return f"error: {e}"


def run_tool(root: Path, name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return "error: arguments are not JSON"
    if not isinstance(args, dict):
        return "error: arguments must be an object"
    try:
        if name == "calculate":
            return calculate(str(args.get("expression", "")))
        if name == "read_file":
            return read_file(root, str(args.get("path", "")))
        if name == "list_dir":
            return list_dir(root, str(args.get("path", ".")))
    except Exception as e:  # a tool bug is the model's observation, not the agent's crash
        return f"error: {type(e).__name__}: {e}"
    return f"error: unknown tool {name}"


# --- the loop -------------------------------------------------------------------------------


def react(client: OpenAI, model: str, task: str, root: Path, max_turns: int, max_tokens: int,
          demos: bool = True) -> str | None:
    program = f"react-{uuid.uuid4().hex[:12]}"
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, *(DEMOS if demos else []),
                            {"role": "user", "content": task}]
    print(f"task: {task}\nprogram: {program}")
    answer = None
    for turn in range(1, max_turns + 1):
        t0 = time.perf_counter()
        r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0,
                                           max_tokens=max_tokens, extra_headers={"X-Program-Id": program})
        ms = (time.perf_counter() - t0) * 1e3
        u = r.usage
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
        choice = r.choices[0]
        print(f"turn {turn}: prompt {u.prompt_tokens} tokens, cached {cached} "
              f"({100 * cached / max(u.prompt_tokens, 1):.0f}%), completion {u.completion_tokens}, "
              f"{ms:.0f} ms, finish {choice.finish_reason}")
        msg = choice.message
        messages.append(msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if not msg.tool_calls:
            answer = (msg.content or "").strip()
            break
        for call in msg.tool_calls:
            result = run_tool(root, call.function.name, call.function.arguments)
            print(f"  {call.function.name}({call.function.arguments}) -> {result[:100]!r}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    # The task is over: end the program so its pinned KV is released now, not at TTL expiry.
    httpx.post(f"{client.base_url}programs/{program}/end", timeout=10,
               headers={"Authorization": f"Bearer {client.api_key}"}).raise_for_status()
    return answer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("task", nargs="*", default=["Which files are in the folder examples?"],
                    help="one or more tasks, each run as its own program")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    ap.add_argument("--model", default=None, help="default: the first model the server lists")
    ap.add_argument("--root", default=".", help="the folder the file tools may read")
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--no-demos", action="store_true", help="leave out the worked examples")
    args = ap.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    failed = 0
    for task in args.task:
        t0 = time.perf_counter()
        answer = react(client, model, task, Path(args.root).resolve(), args.max_turns, args.max_tokens,
                       not args.no_demos)
        print(f"answer: {answer if answer is not None else '(no answer within --max-turns)'}")
        print(f"total {time.perf_counter() - t0:.2f} s\n")
        failed += answer is None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
