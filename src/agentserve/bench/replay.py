"""`agentserve bench run`: replay an agent workload against any OpenAI-compatible
server and measure job completion time (JCT), TTFT and prefix hits.

    agentserve serve --port 8011 &
    agentserve bench run --url http://127.0.0.1:8011 --workload swebench --programs 8 --rate 0.5 \\
        --token-scale 0.02 --time-scale 0.2 --json run.json --report run.md --plot run

What a program does (one asyncio task per program; programs start at the
workload's Poisson arrival times, the first at once):

* turn 0 sends [system, user]: the system prompt is the workload's shared
  prefix (`shared_prefix_tokens`), the same text for every program; the user
  message is the rest of call 0's prompt (the task).
* every turn is one streamed POST /v1/chat/completions with header
  `X-Program-Id`, temperature 0, `max_tokens` = the trace's output tokens
  (scaled, >= 1), `ignore_eos` (vLLM's name; servers that do not know it ignore
  it; `--no-ignore-eos` leaves it out) and `stream_options.include_usage`; the
  last turn adds `end_program: true`. TTFT = first non-empty content (or tool
  call) delta; latency = last byte of the stream. `--api responses`,
  `responses-chain` or `messages` sends the same conversation over the
  Responses API (the whole input with `store: false` and `prompt_cache_key`,
  or chained with `previous_response_id`) or the Anthropic Messages API
  (`x-claude-code-session-id`), read back the same way (replay_apis.py).
* the model's ACTUAL output is appended as the assistant message, the client
  sleeps the call's `tool_duration` x `--time-scale`, then appends a tool-result
  message of `prompt_k - prompt_{k-1} - output_{k-1}` tokens (scaled; for a
  pure-append trace that is `new_tokens`) and sends the next turn. A tool result
  is a `user` message by default (mini-swe-agent's format, accepted by every
  server); `--tool-role tool` sends the assistant message with a synthetic tool
  call and a `tool` message answering it instead. When a trace's prompt
  shrinks (a compaction) the conversation restarts as [system, user] of the new
  prompt's length. A trace that rewrote part of its prompt (new_tokens larger
  than the growth) is replayed as a pure append of the same length.
* SWE-smith programs (Program.messages with message_index) send their real
  system/user/tool text, each message cut to `--token-scale` of its characters;
  assistant messages are still the model's own output.
* a subagent (Program.parent_id in the run) starts at its own arrival but not
  before its parent's spawning turn (parent_turn) has answered.

Text of a given token length is deterministic filler (seeded common words;
the seed is fresh per run unless `--text-seed` is given, so a second run
against the same server does not hit the first run's cached text).
Its tokens per word and the template's tokens per message are calibrated once
per run with three non-streamed probes (usage.prompt_tokens), unless
`--tokens-per-word` is given. Lengths are targets, so a turn's measured
prompt_tokens is close to, not equal to, the scaled trace.

`--max-context` (default: the server's `max_model_len` from /v1/models, if it
reports one): a program whose scaled prompt + output would not fit (with a 3%
margin) is clamped to it (`--clamp`, replay_plan.py): `scale` multiplies its own
tokens (task, outputs, tool results; not the shared system prompt) by one more
factor < 1 so it fits, keeping its turn count and prefix structure (`clamp` in
its result); `truncate` keeps the turns at their real lengths and ends the
program after the last that fits, a first prompt too long by itself (the Claude
Code traces' tool definitions and system prompt) cut to half the context, and a
subagent launched after the cut left out; `auto` (the default) truncates the
Claude Code traces and scales the rest. One line on stderr and the report count
what was clamped. `--max-output-tokens N` bounds every turn's output first (the
report says so). At run time max_tokens is also capped to the room left.

Per program: JCT = first request sent -> last response received (tool time
included). Per turn: TTFT, latency, prompt/cached/completion tokens. A request
that fails (HTTP error, error event, connection error, or `--request-timeout`
seconds in total) is recorded with its error and ends its program (counted in
`failed` / `errors`); the run goes on. With `--retry-failed-turns N` a turn
the server failed (a 5xx, a stream ended by an error event, a dropped
connection) is sent again up to N times, as an agent framework would; each
failed attempt stays in the records with its error and the next has `attempt`.
"""

from __future__ import annotations

import argparse
import sys

from agentserve.bench.replay_apis import API_NAMES
from agentserve.bench.replay_client import ReplayConfig, replay
from agentserve.bench.replay_results import write_json
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
    p.add_argument("--programs", type=int, default=20, help="programs to replay")
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
    p.add_argument("--compare", nargs="+", default=[], metavar="JSON",
                   help="earlier result JSONs to overlay in the JCT CDF, table and report")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=cmd_run)
    return p


def add_clamp_args(p: argparse.ArgumentParser) -> None:
    """--clamp and --max-output-tokens (bench run and bench compare)."""
    from agentserve.bench.replay_plan import CLAMPS

    p.add_argument("--clamp", choices=CLAMPS, default="auto",
                   help="how a program longer than the context is fitted: scale its tokens down, or truncate it "
                        "after its last turn that fits, at real lengths (auto: truncate for claude-code, scale "
                        "for the rest)")
    p.add_argument("--max-output-tokens", type=int, default=None, metavar="N",
                   help="bound every turn's output at N tokens (printed in the report; default: the trace's)")


def check_clamp_args(a) -> None:
    from agentserve.cli_errors import CliError

    if a.max_output_tokens is not None and a.max_output_tokens < 1:
        raise CliError("--max-output-tokens must be at least 1")


def _check_args(a) -> None:
    from agentserve.cli_errors import CliError

    if a.programs < 1:
        raise CliError("--programs must be at least 1")
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
    from agentserve.workload.load import load_workload

    _check_args(a)
    compare = []
    for path in a.compare:
        try:
            compare.append(rr.load_result(path))
        except (OSError, ValueError) as e:
            raise CliError(f"--compare {path}: {e}") from None
    try:
        programs = load_workload(a.workload, a.programs, a.rate, a.seed, path=a.traces)
    except (OSError, ValueError) as e:
        raise CliError(str(e)) from None
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
    results = [result] + compare
    print(rr.format_table(results))
    print(rr.format_time_table(results))
    print()
    print(rr.format_turn_table(result))
    if result["errors"]:
        print(f"\n{result['errors']} failed requests: " +
              "; ".join(f"{n}x {k}" for k, n in result["error_kinds"].items()))
    plots = {}
    if a.plot:
        plots = rr.write_plots(results, a.plot)
        for path in plots.values():
            print(f"wrote {path}", file=sys.stderr)
    if a.json:
        write_json(result, a.json)
        print(f"wrote {a.json}", file=sys.stderr)
    if a.report:
        rr.write_markdown(results, a.report, plots)
        print(f"wrote {a.report}", file=sys.stderr)
    return 0 if result["completed"] else 1

