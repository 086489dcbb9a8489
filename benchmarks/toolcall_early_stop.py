"""Tokens the streaming tool-call validator's early stop saves, measured: every turn of the
paper's agent workloads (benchmarks/novel_workloads.py, each turn's conversation scripted up to it)
is decoded greedily twice on the real model, once plainly and once with the validator the
server attaches (server/tool_validation.py), and the output tokens are compared.

    python -m benchmarks toolcall-early-stop                       # bugfix6 + deepcoding35
    python -m benchmarks toolcall-early-stop --runs 2 --turns 6 --json early_stop.json

Tokens saved on a turn = plain output tokens - validated output tokens: exact, since greedy
decoding of the same prompt is the same until the validator stops it (each pair runs alone,
after a one-token warm-up, so both find the same prefix-cache state, and without speculation by
default; the table says whether the validated output is a prefix of the plain one, token for
token). A tool turn is one whose reply,
parsed by the server's output parser, makes a call in either run."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any

from agentserve.engine.sampling_params import SamplingParams
from agentserve.policy.toolcall_stream import ValidatorStats
from agentserve.server.tool_output import parse_tool_output, tool_choice_for
from agentserve.server.tool_validation import ValidatorConfig, with_validator


@dataclass
class TurnResult:
    workload: str
    run: str
    turn: int
    prompt_tokens: int
    plain_tokens: int
    validated_tokens: int
    plain_finish: str | None
    validated_finish: str | None
    plain_calls: int  # calls the server's parser finds in the plain reply
    validated_calls: int
    prefix: bool  # the validated output is a prefix of the plain one (token ids and text)
    stop: str | None  # "call" when the validator ended the request, else None

    @property
    def saved(self) -> int:
        return self.plain_tokens - self.validated_tokens


def measure_turn(llm: Any, messages: list[dict], tools: list[dict], max_tokens: int, config: ValidatorConfig,
                 stats: ValidatorStats, label: tuple[str, str, int], program_id: str | None = None) -> TurnResult:
    """One turn, plain then validated (greedy, alone)."""
    ids = llm.tokenizer.encode(llm.chat_template.render(messages, tools=tools))
    choice = tool_choice_for([t["function"]["name"] for t in tools], "auto")
    pids = [program_id]
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0), program_ids=pids)  # same cache state for both
    base = SamplingParams(max_tokens=max_tokens, temperature=0)
    plain = llm.generate([ids], base, program_ids=pids)[0]
    params = with_validator(config, stats, choice, base)
    validated = llm.generate([ids], params, program_ids=pids)[0]
    v = params.tool_validator
    n = len(validated.token_ids)
    prefix = validated.token_ids == plain.token_ids[:n] and plain.text.startswith(validated.text)
    return TurnResult(*label, prompt_tokens=len(ids), plain_tokens=len(plain.token_ids), validated_tokens=n,
                      plain_finish=plain.finish_reason, validated_finish=validated.finish_reason,
                      plain_calls=len(parse_tool_output(plain.text, choice)[1]),
                      validated_calls=len(parse_tool_output(validated.text, choice)[1]), prefix=prefix,
                      stop=v.stop_reason if v is not None and v.done else None)


def summarize(results: list[TurnResult]) -> dict[str, Any]:
    tool = [r for r in results if r.plain_calls or r.validated_calls]
    plain = sum(r.plain_tokens for r in results)
    saved = sum(r.saved for r in results)
    tool_plain = sum(r.plain_tokens for r in tool)
    tool_saved = sum(r.saved for r in tool)
    return {
        "turns": len(results), "tool_turns": len(tool), "early_stops": sum(r.stop == "call" for r in results),
        "plain_tokens": plain, "saved_tokens": saved, "saved_share": saved / plain if plain else 0.0,
        "tool_turn_plain_tokens": tool_plain, "tool_turn_saved_tokens": tool_saved,
        "saved_per_tool_turn": tool_saved / len(tool) if tool else 0.0,
        "tool_turn_saved_share": tool_saved / tool_plain if tool_plain else 0.0,
        "plain_calls": sum(r.plain_calls for r in results), "validated_calls": sum(r.validated_calls for r in results),
        "all_prefix": all(r.prefix for r in results),
    }


def table(results: list[TurnResult]) -> str:
    head = f"{'workload':<13}{'run':>4}{'turn':>5}{'prompt':>7}{'plain':>6}{'valid.':>7}{'saved':>6}  " \
           f"{'finish plain/valid.':<20}{'calls':>6}  prefix"
    rows = [head]
    for r in results:
        rows.append(f"{r.workload:<13}{r.run[-4:]:>4}{r.turn:>5}{r.prompt_tokens:>7}{r.plain_tokens:>6}"
                    f"{r.validated_tokens:>7}{r.saved:>6}  {f'{r.plain_finish}/{r.validated_finish}':<20}"
                    f"{f'{r.plain_calls}/{r.validated_calls}':>6}  {'yes' if r.prefix else 'NO'}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.novel_workloads import NOVEL, novel_runs, scripted_prompt

    ap = argparse.ArgumentParser(prog="python -m benchmarks toolcall-early-stop", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="model: 'default', a .gguf file or a Hugging Face folder")
    ap.add_argument("--workloads", nargs="+", default=["bugfix6", "deepcoding35"], choices=sorted(NOVEL))
    ap.add_argument("--runs", type=int, default=1, help="agent runs per workload")
    ap.add_argument("--turns", type=int, default=6, help="turns per run at most")
    ap.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every turn (the paper's 128)")
    ap.add_argument("--grace-tokens", type=int, default=ValidatorConfig().grace_tokens)
    ap.add_argument("--speculate", type=int, default=0,
                    help="prompt-lookup draft tokens (default 0: off, so that both runs of a turn decode step by "
                         "step and stay identical until the stop; with drafts, verification batches differ and "
                         "bfloat16 rounding can make greedy outputs part)")
    ap.add_argument("--json", default=None, help="write the turns and the summary here")
    args = ap.parse_args(argv)

    from agentserve.llm import LLM

    llm = LLM(None if args.model == "default" else args.model, kv_cache_tokens=32768, max_num_seqs=4,
              speculate=args.speculate)
    config, stats = ValidatorConfig(grace_tokens=args.grace_tokens), ValidatorStats()
    results = []
    for wl in args.workloads:
        for run in novel_runs(wl, args.runs):
            for k in range(min(args.turns, len(run.turns))):
                r = measure_turn(llm, scripted_prompt(run, k), list(run.tools), args.max_tokens, config, stats,
                                 (wl, run.run_id, k))
                results.append(r)
                print(table([r]).splitlines()[1], file=sys.stderr, flush=True)
    summary = summarize(results)
    print(table(results))
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "summary": summary, "counters": asdict(stats.counts()),
                       "turns": [asdict(r) | {"saved": r.saved} for r in results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
