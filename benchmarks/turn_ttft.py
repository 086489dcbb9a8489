"""Time to first token per turn of one agent-like program against a running
OpenAI-compatible server: each turn re-sends the whole conversation plus a
small tool-result delta, as an agent does. With program-aware KV retention
a later turn prefills only the delta, so its TTFT should not grow with the
prompt. Prints a table and writes JSON.

    agentserve serve &    # or any OpenAI-compatible server
    python -m benchmarks turn-ttft --url http://127.0.0.1:8000 --turns 5 --json ttft.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid

import httpx

TASK = ("You are a coding agent. List the files of the project, read the README, and say in one sentence "
        "what the project does.")
TOOL_RESULTS = [
    "README.md\nsrc/\ntests/\npyproject.toml",
    "# agentserve\nAn LLM inference server for agent workloads.",
    "src/agentserve/: cli.py llm.py engine/ kv/ policy/ runner/ server/ sim/ bench/",
    "tests/: 20 files, 450 tests",
    "pyproject.toml: name = agentserve, requires torch, gguf, tokenizers",
    "LICENSE: Apache-2.0",
]


def one_turn(client: httpx.Client, url: str, model: str, messages: list[dict], program: str,
             max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage = None, [], {}
    with client.stream("POST", url + "/v1/chat/completions", json=body, headers={"X-Program-Id": program}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", ()):
                piece = ch.get("delta", {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
    total = time.perf_counter() - t0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total, "text": "".join(text),
            "prompt_tokens": usage.get("prompt_tokens", 0), "cached_tokens": cached or 0}


def run(url: str, model: str | None, turns: int, repeats: int, max_tokens: int) -> list[dict]:
    rows = []
    with httpx.Client(timeout=300) as client:
        model = model or client.get(url + "/v1/models").json()["data"][0]["id"]
        for rep in range(repeats):
            program = f"ttft-{uuid.uuid4().hex[:8]}"
            messages = [{"role": "user", "content": TASK}]
            for turn in range(1, turns + 1):
                res = one_turn(client, url, model, messages, program, max_tokens)
                rows.append({"repeat": rep, "turn": turn, **{k: v for k, v in res.items() if k != "text"}})
                messages += [{"role": "assistant", "content": res["text"]},
                             {"role": "user", "content": "Tool result:\n" + TOOL_RESULTS[turn % len(TOOL_RESULTS)]}]
    return rows


def summarize(rows: list[dict], turns: int) -> list[dict]:
    out = []
    for t in range(1, turns + 1):
        sel = [r for r in rows if r["turn"] == t]
        out.append({"turn": t, "median_ttft_s": statistics.median(r["ttft_s"] for r in sel),
                    "median_prompt_tokens": statistics.median(r["prompt_tokens"] for r in sel),
                    "median_cached_tokens": statistics.median(r["cached_tokens"] for r in sel)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks turn-ttft", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model name (default: the server's first)")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="programs run one after another (medians reported)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        rows = run(args.url.rstrip("/"), args.model, args.turns, args.repeats, args.max_tokens)
    except httpx.HTTPError as e:
        print(f"turn_ttft: error: {e}", file=sys.stderr)
        return 2
    summary = summarize(rows, args.turns)
    print(f"{'turn':>4}  {'prompt tok':>10}  {'cached tok':>10}  {'TTFT ms':>8}")
    for s in summary:
        print(f"{s['turn']:>4}  {s['median_prompt_tokens']:>10.0f}  {s['median_cached_tokens']:>10.0f}  "
              f"{s['median_ttft_s'] * 1e3:>8.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
