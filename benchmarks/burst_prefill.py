"""`python -m benchmarks burst`: a burst of agents that share one long preamble
(system prompt and tool schemas) arrives at once; grouped prefill on and off,
side by side on the real model.

    python -m benchmarks burst                                  # 8 agents, 2048-token preamble
    python -m benchmarks burst --agents 16 --budgets 512,4096 --json burst.json

For each step budget (--max-num-batched-tokens) and each setting it reports
the prompt tokens the model computed, the prefix hits, and the median and p99
time to first token over the burst. Every agent's prompt is the shared
preamble plus its own task, so without grouping the preamble's blocks can be
computed once per agent admitted before the first one has finished them."""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass

from benchmarks.common import run_main, write_run_json


@dataclass
class BurstResult:
    budget: int
    grouped: bool
    agents: int
    prompt_tokens: int  # all agents' prompts
    computed_tokens: int  # prompt tokens the model ran
    hit_tokens: int
    grouped_requests: int
    ttft_median_s: float
    ttft_p99_s: float
    wall_s: float


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def burst_prompts(vocab: int, agents: int, preamble: int, own: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # ordinary ids, clear of the special tokens at either end of the vocabulary
    lo, hi = 300, min(vocab, 40000) - 1
    shared = [rng.randrange(lo, hi) for _ in range(preamble)]
    return [shared + [rng.randrange(lo, hi) for _ in range(own)] for _ in range(agents)]


def run_burst(model, agents: int, preamble: int, own: int, max_tokens: int, budgets: list[int],
              seed: int, **llm_options) -> list[BurstResult]:
    """`model`: a path, None (the default model) or a LoadedModel; `llm_options` go to LLM."""
    from agentserve.engine.sampling_params import SamplingParams
    from agentserve.llm import LLM
    from agentserve.runner.checkpoint import LoadedModel
    from agentserve.runner.loader import load_model

    loaded = model if isinstance(model, LoadedModel) else load_model(model, keep_quantized=True)
    results = []
    for budget in budgets:
        for grouped in (False, True):
            llm = LLM(loaded, max_num_batched_tokens=budget, group_prefill=grouped,
                      kv_cache_tokens=max(16384, 2 * agents * (preamble + own + max_tokens)), **llm_options)
            prompts = burst_prompts(llm.config.vocab_size, agents, preamble, own, seed)
            # warm up the kernels and the step-time model on an unrelated prompt
            llm.generate([prompts[0][-64:]], SamplingParams(max_tokens=4, temperature=0.0))
            before = llm.scheduler.stats.prefill_tokens, llm.scheduler.stats.hit_tokens
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            t0 = llm.clock.now()
            outs = llm.generate(prompts, params)
            wall = llm.clock.now() - t0
            st = llm.scheduler.stats
            ttfts = [o.first_token_time - o.arrival_time for o in outs]
            results.append(BurstResult(budget, grouped, agents, sum(map(len, prompts)),
                                       st.prefill_tokens - before[0], st.hit_tokens - before[1],
                                       st.grouped_requests, _quantile(ttfts, 0.5), _quantile(ttfts, 0.99), wall))
            llm.check_integrity()
            del llm
    return results


def print_table(results: list[BurstResult], out=None) -> None:
    out = sys.stdout if out is None else out  # read at call time: a default bound at import goes stale
    print(f"{'budget':>7} {'grouped':>7} {'prompt tok':>10} {'computed':>9} {'hits':>7} {'waited':>6} "
          f"{'TTFT p50 s':>10} {'TTFT p99 s':>10} {'wall s':>7}", file=out)
    for r in results:
        print(f"{r.budget:>7} {'on' if r.grouped else 'off':>7} {r.prompt_tokens:>10} {r.computed_tokens:>9} "
              f"{r.hit_tokens:>7} {r.grouped_requests:>6} {r.ttft_median_s:>10.2f} {r.ttft_p99_s:>10.2f} "
              f"{r.wall_s:>7.2f}", file=out)


def build_parser() -> argparse.ArgumentParser:
    from agentserve.argtypes import csv_list

    p = argparse.ArgumentParser(prog="python -m benchmarks burst",
                                description=__doc__.split("\n\n")[0].replace("`python -m benchmarks burst`: ", ""))
    p.add_argument("--model", default=None, help="a GGUF or safetensors model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--agents", type=int, default=8, help="requests in the burst (default 8)")
    p.add_argument("--preamble", type=int, default=2048, help="tokens every prompt shares (default 2048)")
    p.add_argument("--own", type=int, default=96, help="tokens of each agent's own task (default 96)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each agent decodes (default 16)")
    p.add_argument("--budgets", type=csv_list(int), default=[512, 4096],
                   help="step token budgets (--max-num-batched-tokens) to run at (default 512,4096)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results here")
    return p


def cmd_burst(args) -> int:
    from agentserve.cli_errors import CliError

    if args.agents < 1 or args.preamble < 1 or args.own < 1 or args.max_tokens < 1:
        raise CliError("--agents, --preamble, --own and --max-tokens must be >= 1")
    results = run_burst(args.model, args.agents, args.preamble, args.own, args.max_tokens, args.budgets, args.seed)
    print_table(results)
    if args.json:
        write_run_json(args, results, args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), cmd_burst, argv)


if __name__ == "__main__":
    sys.exit(main())
