"""CPU time the server spends turning one chat request into prompt token ids, at
agent conversation lengths, with the render/tokenize cache off and on
(server/render_cache.py). Prints a table and writes JSON.

    python -m benchmarks render-cost --json render_cost.json
    python -m benchmarks render-cost --model path/to/model.gguf --tokens 5000 30000 --repeats 20

The conversation is a coding agent's: a task, then turns of one `read_file`
tool call and its result (agentserve's own source files, 2500 characters
each), until it holds the target number of tokens. Each measured request is an
agent's next turn: the conversation with its last call and result appended,
sent to a cache that holds the turn before (a fresh cache every repeat), and
timed through the server's own call site (`chat_run.render_chat`: the message
dump, the template, the tokenizer). `off` is that request without the cache,
`retry` the same request sent twice (the second timed). Parsing and validating
the JSON body, which no cache can spare, is shown beside them. Times are the
process's CPU time (all threads), medians over the repeats."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from agentserve.server.chat_run import render_chat
from agentserve.server.chat_template import ChatTemplate
from agentserve.server.protocol import ChatCompletionRequest
from agentserve.server.render_cache import RenderCache

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
TASK = "The test suite fails in the server package. Find the bug and fix it."
RESULT_CHARS = 2500


def load_prompt_side(model: str | None) -> tuple[Any, ChatTemplate, str]:
    """(tokenizer, chat template, name) of a GGUF model, read from its metadata only (no weights)."""
    from agentserve.runner.gguf_loader import open_gguf, read_metadata
    from agentserve.runner.loader import default_model_path
    from agentserve.runner.tokenizer import Tokenizer

    path = Path(model) if model else default_model_path()
    meta = read_metadata(open_gguf(path))
    return Tokenizer.from_gguf_metadata(meta), ChatTemplate(meta.get("tokenizer.chat_template")), path.name


def source_files() -> list[Path]:
    """agentserve's own larger source files, the tool results the agent reads."""
    import agentserve

    root = Path(agentserve.__file__).resolve().parent
    return sorted(p for p in root.rglob("*.py") if p.stat().st_size > RESULT_CHARS)


def conversation(tokenizer: Any, template: ChatTemplate, target: int) -> list[dict]:
    """An agent's messages, grown turn by turn until the prompt holds `target` tokens."""
    msgs: list[dict] = [{"role": "system", "content": "You are a careful coding agent."},
                        {"role": "user", "content": TASK}]
    files = source_files()
    for i in range(10_000):
        if len(tokenizer.encode(template.render(msgs, tools=TOOLS))) >= target:
            return msgs
        f = files[i % len(files)]
        rel = str(f.relative_to(f.parents[2]))
        msgs.append({"role": "assistant", "content": "", "tool_calls": [{
            "id": f"call_{i}", "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": rel})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{i}", "content": f.read_text()[:RESULT_CHARS]})
    raise RuntimeError("the conversation did not grow")


def _cpu_ms(fn) -> float:
    t = time.process_time()
    fn()
    return (time.process_time() - t) * 1e3


def measure(tokenizer: Any, template: ChatTemplate, target: int, repeats: int) -> dict:
    msgs = conversation(tokenizer, template, target)
    body = json.dumps({"model": "m", "messages": msgs, "tools": TOOLS, "max_tokens": 128})
    req = ChatCompletionRequest.model_validate(json.loads(body))
    before = ChatCompletionRequest.model_validate({"model": "m", "messages": msgs[:-2], "tools": TOOLS})
    llm = SimpleNamespace(chat_template=template, tokenizer=tokenizer)
    off_state = SimpleNamespace(llm=llm, render_cache=None)
    reference = render_chat(off_state, req)
    rows: dict[str, list[float]] = {"parse": [], "off": [], "on": [], "retry": [], "render": []}
    window = 0
    for _ in range(repeats):
        rows["parse"].append(_cpu_ms(lambda: ChatCompletionRequest.model_validate(json.loads(body))))
        rows["off"].append(_cpu_ms(lambda: render_chat(off_state, req)))
        rows["render"].append(_cpu_ms(lambda: template.render(msgs, tools=TOOLS)))
        on_state = SimpleNamespace(llm=llm, render_cache=RenderCache(template, tokenizer))
        render_chat(on_state, before)  # the turn before, as the server saw it
        tokenized = on_state.render_cache.stats().tokenized_tokens
        out: list[list[int]] = []
        rows["on"].append(_cpu_ms(lambda: out.append(render_chat(on_state, req))))
        window = on_state.render_cache.stats().tokenized_tokens - tokenized
        rows["retry"].append(_cpu_ms(lambda: out.append(render_chat(on_state, req))))
        if any(ids != reference for ids in out):
            raise AssertionError("the cached ids differ from a full tokenization")
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"target_tokens": target, "prompt_tokens": len(reference),
            "prompt_chars": len(template.render(msgs, tools=TOOLS)), "messages": len(msgs),
            "tokenized_on_next_turn": window, "median_cpu_ms": med, "samples_cpu_ms": rows,
            "speedup": med["off"] / med["on"] if med["on"] else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks render-cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[5000, 30000], help="conversation sizes in tokens")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    tokenizer, template, name = load_prompt_side(args.model)
    results = [measure(tokenizer, template, n, args.repeats) for n in args.tokens]
    print(f"{name}: CPU ms per chat request (median of {args.repeats}), prompt tokens from the chat messages")
    print(f"{'prompt tok':>10}  {'msgs':>4}  {'delta tok':>9}  {'parse+validate':>14}  {'cache off':>9}  "
          f"{'(render)':>8}  {'next turn':>9}  {'retry':>6}  {'speedup':>7}")
    for r in results:
        m = r["median_cpu_ms"]
        print(f"{r['prompt_tokens']:>10}  {r['messages']:>4}  {r['tokenized_on_next_turn']:>9}  "
              f"{m['parse']:>14.2f}  {m['off']:>9.2f}  {m['render']:>8.2f}  {m['on']:>9.2f}  {m['retry']:>6.2f}  "
              f"{r['speedup']:>6.1f}x")
    if args.json:
        env = {"model": name, "python": platform.python_version(), "machine": platform.machine(),
               "cpu": _cpu_name(), "cpus": os.cpu_count(), "repeats": args.repeats}
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": results}, f, indent=1)
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
