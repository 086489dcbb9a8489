"""How fast the real runner is on this machine: prefill tokens/s (512 and 2048
tokens), decode tokens/s at batch 1, 8 and 32 (bare forward steps at a
512-token context, and through the whole engine), and the batch-1 decode
roofline (measured read bandwidth / weight bytes), per dtype. Prints a table
and writes JSON.

    python -m agentserve.bench.runner_speed --dtypes float32,bfloat16 --json runner_speed.json
    python -m agentserve.bench.runner_speed --ab-packing     # packed vs plain bf16 weights, side by side

The torch work lives in `agentserve.runner.profiling`; this script only
orchestrates and reports."""

from __future__ import annotations

import argparse
import json
import sys

PREFILL = (512, 2048)
BATCHES = (1, 8, 32)
CONTEXT = 512


def measure(dtype: str, model: str | None, repeats: int) -> dict:
    from agentserve.llm import LLM
    from agentserve.runner.profiling import ModelTimer, engine_decode_rate, median_time, read_bandwidth

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


def ab_packing(model: str | None, rounds: int = 3) -> list[dict]:
    """bfloat16 with oneDNN-packed weights against plain weights, measured in
    alternation in one process (medians over rounds), so machine noise hits both."""
    import statistics

    from agentserve.llm import LLM
    from agentserve.runner.profiling import ModelTimer, median_time

    llms = {name: LLM(model, dtype="bfloat16", kv_cache_tokens=max(BATCHES) * (CONTEXT + 16) + 4096,
                      policy="vllm-fcfs", pack_weights=pack) for name, pack in (("packed", True), ("plain", False))}
    points = [(f"decode b{b}", b, lambda t, b=b: t.decode(b, CONTEXT)) for b in (1, 8)] + \
        [("prefill 512", 512, lambda t: t.prefill(512))]
    got: dict = {name: {p[0]: [] for p in points} for name in llms}
    for _ in range(rounds):
        for name, llm in llms.items():
            timer = ModelTimer(llm)
            for label, tokens, make in points:
                got[name][label].append(tokens / median_time(make(timer), llm.device, repeats=5))
    rows = []
    for label, _, _ in points:
        packed, plain = (statistics.median(got[n][label]) for n in ("packed", "plain"))
        rows.append({"point": label, "packed_tok_s": packed, "plain_tok_s": plain, "ratio": packed / plain})
    return rows


def format_table(rows: list[dict]) -> str:
    cols = [("dtype", "dtype", "{}")] + [(f"prefill {n}", f"prefill_{n}_tok_s", "{:.0f}") for n in PREFILL] \
        + [(f"decode b{b}", f"decode_b{b}_tok_s", "{:.1f}") for b in BATCHES] \
        + [(f"engine b{b}", f"engine_decode_b{b}_tok_s", "{:.1f}") for b in BATCHES] \
        + [("read GB/s", "read_bandwidth_gb_s", "{:.1f}"), ("roofline b1", "roofline_b1_tok_s", "{:.0f}")]
    lines = [[c[0] for c in cols]] + [[fmt.format(r[k]) for _, k, fmt in cols] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file or HF folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per point (median reported)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--ab-packing", action="store_true",
                    help="instead: packed against plain bfloat16 weights, side by side")
    args = ap.parse_args(argv)
    if args.ab_packing:
        rows = ab_packing(args.model)
        print(f"{'point':>12}  {'packed tok/s':>12}  {'plain tok/s':>11}  {'ratio':>5}")
        for r in rows:
            print(f"{r['point']:>12}  {r['packed_tok_s']:>12.1f}  {r['plain_tok_s']:>11.1f}  {r['ratio']:>5.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    rows = []
    for dt in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
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
