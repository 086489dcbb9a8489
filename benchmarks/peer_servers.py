"""The peer servers of agentserve.bench.peers from the shell: `list` prints each
one's spec (command line, environment, KV setting) and what is missing to run
it; `smoke` starts each, sends one greedy chat completion, stops it and prints
the timings as JSON lines. Installing the peers: peers/README.md beside this file.

    python -m benchmarks peers list [NAMES]
    python -m benchmarks peers smoke [NAMES]
    python -m benchmarks peers smoke llama-server agentserve-agentserve --model gemma3-270m --kv-tokens 16384
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error

from agentserve.bench.peers.running import RunningServer, http_json, start_server
from agentserve.bench.peers.specs import (
    DEFAULT_MODEL,
    LLAMASERVER_SLOTS,
    MODELS,
    SERVER_NAMES,
    VLLM_RESERVED_CPUS,
    VLLM_RESERVED_CPUS_HELP,
    PeerServerError,
    reserved_cpus_arg,
    server_specs,
)


def chat(srv: RunningServer, prompt: str, max_tokens: int = 32, timeout_s: float = 120.0) -> dict:
    """One non-streaming, greedy chat completion (a smoke check)."""
    return http_json(srv.api_base + "/chat/completions",
                     {"model": srv.spec.model_name, "messages": [{"role": "user", "content": prompt}],
                      "max_tokens": max_tokens, "temperature": 0.0}, timeout_s=timeout_s)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks peers",
                                description="List the peer servers, or start one, send one chat completion, "
                                            "stop it and print the timings (a smoke check).")
    p.add_argument("action", choices=["list", "smoke"])
    p.add_argument("servers", nargs="*", help=f"names (default: all): {', '.join(SERVER_NAMES)}")
    p.add_argument("--kv-tokens", type=int, default=32768)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=DEFAULT_MODEL, choices=MODELS, help="the model every server serves")
    p.add_argument("--llama-server-slots", type=int, default=LLAMASERVER_SLOTS, help="llama-server's --parallel")
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--vllm-reserved-cpus", type=reserved_cpus_arg, default=VLLM_RESERVED_CPUS, metavar="N|auto",
                   help=VLLM_RESERVED_CPUS_HELP)
    args = p.parse_args(argv)
    try:
        specs = server_specs(args.servers or SERVER_NAMES, args.kv_tokens, threads=args.threads, model=args.model,
                             slots=args.llama_server_slots, vllm_reserved_cpus=args.vllm_reserved_cpus)
    except (ValueError, PeerServerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.action == "list":
        for s in specs:
            print(json.dumps(s.describe() | {"missing": s.missing()}, indent=1))
        return 0
    failed = 0
    for s in specs:
        row: dict = {"name": s.name}
        try:
            with start_server(s) as srv:
                row["startup_s"] = round(srv.ready_s, 1)
                t0 = time.monotonic()
                out = chat(srv, args.prompt, args.max_tokens)
                row["chat_s"] = round(time.monotonic() - t0, 2)
                row["reply"] = out["choices"][0]["message"]["content"]
                row["finish_reason"] = out["choices"][0].get("finish_reason")
                row["usage"] = out.get("usage")
            row["exit_code"] = srv.process.returncode
        except (PeerServerError, urllib.error.URLError, OSError, KeyError) as e:
            row["error"] = str(e)
            failed += 1
        print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
