"""`agentserve bench run`: replay an agent workload against any OpenAI-compatible
server and measure job completion time (JCT), TTFT and prefix hits. What a
replayed program sends, turn by turn, how its text is made and how a program
longer than the context is fitted: the docs' benchmarks page, "Replaying an
agent workload"."""

from __future__ import annotations

import argparse
import sys

from agentserve.bench.replay_apis import API_NAMES
from agentserve.bench.replay_client import ReplayConfig, replay
from agentserve.bench.replay_stream import ReplayError, base_url


def add_run_parser(subparsers) -> argparse.ArgumentParser:
    """Register `run` (replay a workload against a server) on `subparsers`."""
    p = subparsers.add_parser(
        "run", help="replay an agent workload against an OpenAI-compatible server",
        description="Replay an agent workload against any OpenAI-compatible server: programs arrive as a "
                    "Poisson process, each sends its turns in order (streaming, X-Program-Id header, the "
                    "model's own output appended, tool time slept between turns, end_program on the last "
                    "turn), and the client reports per-program JCT and per-turn TTFT, latency and "
                    "prompt/cached tokens as a table, JSON, a Markdown report and plots.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (a trailing /v1 is accepted)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--workload", default="swebench",
                   help="swebench, bfcl, claude-code, swe-smith, or a JSONL trace file")
    p.add_argument("--traces", default=None, help="recorded trace file/folder (default: the shared traces)")
    p.add_argument("--programs", type=int, default=20, help="programs to replay (0: each recorded session once)")
    p.add_argument("--rate", type=float, default=0.5, help="program arrival rate (jobs/s, Poisson)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and its arrivals")
    p.add_argument("--text-seed", default=None,
                   help="seed of the filler text; the default, a fresh one per run, keeps an earlier run's "
                        "text from hitting the server's prefix cache (give one to send identical text)")
    p.add_argument("--token-scale", type=float, default=1.0, help="multiply every token count of the trace")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply every tool duration")
    p.add_argument("--max-context", type=int, default=None,
                   help="clamp each program to this many tokens (default: the server's max_model_len if reported)")
    add_clamp_args(p)
    p.add_argument("--tokens-per-word", type=float, default=None,
                   help="tokens per filler word (default: calibrate with three probe requests)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take in total before it counts as an error")
    p.add_argument("--retry-failed-turns", type=int, default=0, metavar="N",
                   help="send a turn the server failed (5xx, cut stream, dropped connection) again, up to N times "
                        "(default 0: the failed turn ends its program)")
    p.add_argument("--api", choices=API_NAMES, default="chat",
                   help="the API that carries the turns: chat completions (X-Program-Id); the Responses API with "
                        "the whole input each turn (store false, prompt_cache_key) or chained (responses-chain: "
                        "store true, previous_response_id, only the new items); the Anthropic Messages API "
                        "(x-claude-code-session-id)")
    p.add_argument("--tool-role", choices=("user", "tool"), default="user",
                   help="send tool results as user messages, or as tool messages answering a synthetic tool call")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (outputs may then end before max_tokens)")
    p.add_argument("--label", default=None, help="name of this server in tables and plots (default: the URL)")
    p.add_argument("--json", default=None, help="write the results (summary + per-turn records) here")
    p.add_argument("--report", default=None, help="write a Markdown report here")
    p.add_argument("--plot", default=None,
                   help="PNG prefix: writes PREFIX_jct_cdf.png and PREFIX_timeline.png")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=cmd_run)
    return p


def add_clamp_args(p: argparse.ArgumentParser) -> None:
    """How programs are chosen and fitted (bench run and bench compare)."""
    from agentserve.bench.replay_plan import CLAMPS

    p.add_argument("--clamp", choices=CLAMPS, default="auto",
                   help="how a program longer than the context is fitted: scale its tokens down, or compact it "
                        "at real lengths (a turn that would not fit starts a new conversation: its system prompt "
                        "and a summary, as Claude Code does) (auto: compact for claude-code, scale for the rest)")
    p.add_argument("--max-output-tokens", type=int, default=None, metavar="N",
                   help="bound every turn's output at N tokens (printed in the report; default: the trace's)")
    p.add_argument("--min-turns", type=int, default=None, metavar="N",
                   help="recorded workloads: replay only the sessions with at least N turns")
    p.add_argument("--max-turns", type=int, default=None, metavar="N",
                   help="replay each program's first N turns (a subagent launched after them is left out)")


def check_clamp_args(a) -> None:
    from agentserve.cli_errors import CliError

    if a.max_output_tokens is not None and a.max_output_tokens < 1:
        raise CliError("--max-output-tokens must be at least 1")
    if a.programs < 0:
        raise CliError("--programs must be at least 1 (0: each recorded session once)")
    for flag in ("min_turns", "max_turns"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            raise CliError(f"--{flag.replace('_', '-')} must be at least 1")


def load_programs(a) -> list:
    """The programs `a` asks for (--workload, --programs, --min-turns, --max-turns)."""
    from agentserve.cli_errors import CliError
    from agentserve.workload.load import load_workload

    try:
        return load_workload(a.workload, a.programs or None, a.rate, a.seed, path=getattr(a, "traces", None),
                             min_turns=a.min_turns, max_turns=a.max_turns)
    except (OSError, ValueError) as e:
        raise CliError(str(e)) from None


def _check_args(a) -> None:
    from agentserve.cli_errors import CliError

    if not a.rate > 0:
        raise CliError("--rate must be positive")
    if not a.token_scale > 0 or not a.time_scale >= 0:
        raise CliError("--token-scale must be > 0 and --time-scale >= 0")
    if a.max_context is not None and a.max_context < 16:
        raise CliError("--max-context must be at least 16")
    check_clamp_args(a)
    if a.tokens_per_word is not None and not a.tokens_per_word > 0:
        raise CliError("--tokens-per-word must be positive")
    if not a.request_timeout > 0:
        raise CliError("--request-timeout must be positive")
    if a.retry_failed_turns < 0:
        raise CliError("--retry-failed-turns must be >= 0")
    if a.api == "responses-chain" and a.tool_role == "tool":
        raise CliError("--api responses-chain needs --tool-role user: the server's stored replies hold no calls "
                       "for tool messages to answer")


def cmd_run(a) -> int:
    from agentserve.bench import replay_report as rr
    from agentserve.cli_errors import CliError

    _check_args(a)
    programs = load_programs(a)
    cfg = ReplayConfig(url=a.url, model=a.model, api_key=a.api_key, workload=a.workload, rate=a.rate, seed=a.seed,
                       text_seed=a.text_seed, token_scale=a.token_scale, time_scale=a.time_scale, max_context=a.max_context,
                       tokens_per_word=a.tokens_per_word, request_timeout=a.request_timeout,
                       ignore_eos=a.ignore_eos, tool_role=a.tool_role, label=a.label, progress=a.progress,
                       retry_failed_turns=a.retry_failed_turns, api=a.api, clamp=a.clamp,
                       max_output_tokens=a.max_output_tokens)
    print(f"replaying {len(programs)} programs ({sum(p.num_turns for p in programs)} turns) of {a.workload} "
          f"at {a.rate:g} jobs/s against {base_url(a.url)} over the {a.api} API...", file=sys.stderr)
    try:
        result = replay(programs, cfg)
    except ReplayError as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"cannot reach {a.url}: {e}") from None
    print(rr.format_table([result]))
    print(rr.format_time_table([result]))
    print()
    print(rr.format_turn_table(result))
    if result["errors"]:
        print(f"\n{result['errors']} failed requests: " +
              "; ".join(f"{n}x {k}" for k, n in result["error_kinds"].items()))
    rr.write_outputs([result], plot=a.plot, report=a.report, json_path=a.json, json_obj=result)
    return 0 if result["completed"] else 1

