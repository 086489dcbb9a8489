"""`python -m benchmarks agentic`: the stateful-inference paper's agent workloads
(section 5) against agentserve and, optionally, its peers started in turn on
loopback (agentserve.bench.peers, as `agentserve bench compare` does), or against one
running server (--url).

    python -m benchmarks agentic --workload bugfix6                         # agentserve-continuum alone
    python -m benchmarks agentic --workload deepcoding35 --servers agentserve-continuum,vllm-cpu --json deep.json
    python -m benchmarks agentic --workload repeat --servers agentserve-continuum,vllm-cpu
    python -m benchmarks agentic --workload bugfix6 --url http://127.0.0.1:8000 --label mine

Workloads: bugfix6 and deepcoding35 (novel: every prompt unique, no
response-cache hits; benchmarks/novel_workloads.py) and repeat (the repeated-prompt
patterns, with agentserve's response cache on). vLLM is started with a chat
template that renders the tools exactly as agentserve does and its hermes
tool-call parser (benchmarks/tool_template.py), so both see the same prompt
tokens; llama.cpp's server renders tools its own way (its prompts differ)."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import uuid

from agentserve.bench.peers.running import each_server
from agentserve.bench.peers.specs import (
    SERVER_NAMES,
    VLLM_RESERVED_CPUS,
    VLLM_RESERVED_CPUS_HELP,
    default_peers_dir,
    reserved_cpus_arg,
    server_spec,
)

WORKLOADS = ("bugfix6", "deepcoding35", "repeat")
DEFAULT_RUNS = {"bugfix6": 8, "deepcoding35": 2}
RESPONSE_CACHE_ENTRIES = 1024  # the paper's LRU size


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks agentic",
                                description=__doc__.split("\n\n")[0].replace("`python -m benchmarks agentic`: ", ""))
    p.add_argument("--workload", choices=WORKLOADS, default="bugfix6", help="default bugfix6")
    p.add_argument("--servers", default="agentserve-continuum",
                   help=f"comma-separated, started in turn, from {', '.join(SERVER_NAMES)} "
                        "(default agentserve-continuum; peers need benchmarks/peers/install_*.sh)")
    p.add_argument("--url", default=None, help="measure this running server instead of starting --servers")
    p.add_argument("--label", default=None, help="--url: its name in the table (default: the URL)")
    p.add_argument("--model", default=None, help="--url: the model to send (default: the server's first)")
    p.add_argument("--api-key", default=None, help="--url: sent as 'Authorization: Bearer KEY'")
    p.add_argument("--kv-tokens", type=int, default=16384,
                   help="KV capacity in tokens given to every started server (default 16384)")
    p.add_argument("--vllm-reserved-cpus", type=reserved_cpus_arg, default=VLLM_RESERVED_CPUS, metavar="N|auto",
                   help=VLLM_RESERVED_CPUS_HELP)
    p.add_argument("--agentserve-args", default="",
                   help="extra `agentserve serve` flags for started agentserve servers (one shell-quoted string); "
                        f"repeat adds --response-cache {RESPONSE_CACHE_ENTRIES} unless given")
    p.add_argument("--vllm-args", default="",
                   help="extra vLLM server flags for vllm-cpu (one shell-quoted string; they come last, so they win): "
                        "e.g. --vllm-args=--no-enable-prefix-caching (one flag needs the '=') for the paper's setting, where "
                        "vLLM re-prefilled every turn")
    p.add_argument("--runs", type=int, default=None,
                   help="measured agent runs (default: bugfix6 8, deepcoding35 2)")
    p.add_argument("--warmup", type=int, default=1,
                   help="warm-up runs before the measured ones, not counted (default 1)")
    p.add_argument("--concurrency", type=int, default=1, help="agent runs in flight at once (default 1)")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="max_tokens of every turn; stops are natural (default 128, the paper's)")
    p.add_argument("--tool-choice", choices=("auto", "required"), default="required",
                   help="on the turns the script expects a call: required (default: the server constrains the reply "
                        "to one valid call, ending where the call does) or auto (as in the paper: the model may answer "
                        "without a call, which SmolLM2-135M mostly does; early stop can show); prose turns are auto")
    p.add_argument("--tool-time", type=float, default=0.0,
                   help="seconds a tool takes, slept before its result (default 0)")
    p.add_argument("--iterations", type=int, default=3, help="repeat: passes after the cold one (default 3)")
    p.add_argument("--patterns", default="sequential,interleaved,round-robin",
                   help="repeat: dispatch patterns (default all three)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated runs (default 0)")
    p.add_argument("--salt", default=None, help="goes into every unique name (default: fresh per invocation, the "
                                                "same for every server of it)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take (default 600)")
    p.add_argument("--json", default=None, help="write the rows and the raw per-turn results here")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def serve_supports(flag: str) -> bool:
    """Whether this interpreter's `agentserve serve` has `flag`."""
    try:
        out = subprocess.run([sys.executable, "-m", "agentserve.cli", "serve", "--help"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return flag in out.stdout


def agentserve_extra_args(text: str, workload: str) -> list[str]:
    args = shlex.split(text)
    if workload == "repeat" and not any(a.startswith("--response-cache") for a in args):
        if serve_supports("--response-cache"):
            args += ["--response-cache", str(RESPONSE_CACHE_ENTRIES)]
        else:
            print("note: this agentserve has no --response-cache; the repeat patterns run without it",
                  file=sys.stderr)
    return args


def _check(a) -> None:
    from agentserve.cli_errors import CliError

    if a.runs is not None and a.runs < 1:
        raise CliError("--runs must be at least 1")
    if a.warmup < 0 or a.concurrency < 1 or a.max_tokens < 1 or a.iterations < 1 or a.tool_time < 0:
        raise CliError("--warmup >= 0, --concurrency >= 1, --max-tokens >= 1, --iterations >= 1, --tool-time >= 0")


def measure(a, url: str, label: str, model: str | None, max_context: int | None, salt: str) -> dict:
    """One server: the workload's raw result."""
    from benchmarks import fastpath as fp
    from benchmarks.novel_workloads import novel_runs

    cfg = fp.AgenticConfig(url=url, model=model, api_key=a.api_key if a.url else None, label=label,
                           max_tokens=a.max_tokens, tool_choice=a.tool_choice, concurrency=a.concurrency,
                           tool_time=a.tool_time, request_timeout=a.request_timeout, max_context=max_context,
                           progress=a.progress)
    if a.workload == "repeat":
        patterns = [p.strip() for p in a.patterns.split(",") if p.strip()]
        return fp.run_repeat(cfg, patterns, a.iterations, a.seed, salt)
    n = a.runs or DEFAULT_RUNS[a.workload]
    runs = novel_runs(a.workload, n, a.seed, salt)
    warm = novel_runs(a.workload, a.warmup, a.seed, f"{salt}-warmup") if a.warmup else []
    res = fp.run_novel(runs, cfg, warm)
    res["config"].update(seed=a.seed, salt=salt)
    return res


def report(a, results: list[dict]) -> dict:
    from benchmarks import fastpath_report as fr

    if a.workload == "repeat":
        rows = [r for res in results for r in fr.summarize_repeat(res)]
        rows.sort(key=lambda r: r["pattern"])
        print(f"\nrepeated prompts ({results[0]['config']['agents']} agents x {results[0]['config']['turns']} turns, "
              f"one cold pass then {a.iterations} repeats, one request at a time):")
        print(fr.repeat_table(rows))
        return {"workload": a.workload, "rows": rows, "results": results}
    rows = fr.with_ratios([fr.summarize_novel(r) for r in results])
    print(f"\n{a.workload}: {rows[0]['runs']} runs a server, {a.concurrency} at a time, max_tokens {a.max_tokens}, "
          f"tool_choice {a.tool_choice}; median / ref = median per-turn latency / {rows[0]['reference']}'s")
    print(fr.novel_table(rows))
    print("\nby turn (median ms, median output tokens):")
    print(fr.turn_index_table(results, 1 if a.workload == "bugfix6" else 5))
    for r in rows:
        names = {k: v for k, v in r["counter_names"].items() if v}
        print(f"{r['server']}: counters {names or '(none found)'}; finish reasons {r['finish_reasons']}")
    return {"workload": a.workload, "rows": rows, "results": results}


def cmd_agentic(a) -> int:
    from agentserve.bench.replay_results import write_json
    from agentserve.bench.replay_stream import ReplayError
    from agentserve.cli_errors import CliError

    _check(a)
    results = []
    try:
        if a.url:
            salt = a.salt if a.salt is not None else uuid.uuid4().hex[:8]
            results.append(measure(a, a.url, a.label or a.url, a.model, None, salt))
        else:
            salt = a.salt if a.salt is not None else f"s{a.seed}"
            results = _run_servers(a, salt)
    except (ReplayError, ValueError) as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"cannot reach the server: {e}") from None
    if not results:
        raise CliError("no server could be run")
    out = report(a, results)
    if a.json:
        write_json(out, a.json)
        print(f"wrote {a.json}", file=sys.stderr)
    return 0


def _run_servers(a, salt: str) -> list[dict]:
    from agentserve.bench.replay_stream import ReplayError
    from benchmarks.tool_template import vllm_tool_args, write_template

    names = [n.strip() for n in a.servers.split(",") if n.strip()]
    extra = agentserve_extra_args(a.agentserve_args, a.workload)
    specs = []
    for name in names:
        if name.startswith("agentserve-"):
            args = extra
        elif name == "vllm-cpu":
            args = vllm_tool_args(write_template(default_peers_dir() / "templates")) + shlex.split(a.vllm_args)
        else:
            args = []
            print(f"note: {name} renders tools with its own chat format; its prompts differ from the others'",
                  file=sys.stderr)
        specs.append(server_spec(name, a.kv_tokens, vllm_reserved_cpus=a.vllm_reserved_cpus, extra_args=args))

    def run(spec, srv) -> dict:
        res = measure(a, srv.api_base, spec.name, spec.model_name, spec.max_model_len, salt)
        return res | {"server_setup": spec.describe()}

    return [res for _, res, _ in each_server(specs, run, (ReplayError,)) if res is not None]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import run_main

    return run_main(build_parser(), cmd_agentic, argv)


if __name__ == "__main__":
    sys.exit(main())
