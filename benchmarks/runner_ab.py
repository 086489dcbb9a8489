"""`runner_speed --ab-packing` / `--ab-weights`: two configurations of the real
runner (packed against plain bf16 weights; `--weights native` against the
dequantized weights `auto` would otherwise compute with)
measured in alternation in one process, so the machine's noise hits both."""

from __future__ import annotations

CONTEXT = 512  # decode context, as runner_speed's default table
AB_BATCHES = (1, 8)


def ab_variants(which: str) -> tuple[tuple[str, dict], tuple[str, dict]]:
    """Two LLM configurations measured in alternation: packed against plain bf16
    weights, or native weights against dequantized ones in the dtype `auto`
    computes in here (bfloat16 where the CPU has it natively, else float32)."""
    if which == "packing":
        return (("packed", {"pack_weights": True, "weights": "bf16"}),
                ("plain", {"pack_weights": False, "weights": "bf16"}))
    from agentserve.runner.native import cpu_has_native_bf16

    dense = "bf16" if cpu_has_native_bf16() else "fp32"  # what --dtype auto computes in on this CPU
    return ("native", {"weights": "native", "dtype": "auto"}), (dense, {"weights": dense})


def ab_compare(model: str | None, which: str, rounds: int = 3) -> list[dict]:
    """Two configurations of ab_variants(which) measured in alternation in one
    process (medians over rounds), so machine noise hits both: decode at batch 1
    and 8 (512-token context) and a 512-token prefill, tokens/s, and the bytes a
    decode step reads."""
    import statistics

    from agentserve.llm import LLM
    from agentserve.runner.loader import load_model
    from agentserve.runner.profiling import ModelTimer, median_time

    loaded = load_model(model, keep_quantized=True)
    (a, kw_a), (b, kw_b) = ab_variants(which)
    llms = {name: LLM(loaded, kv_cache_tokens=max(AB_BATCHES) * (CONTEXT + 16) + 4096, policy="vllm-fcfs", **kw)
            for name, kw in ((a, kw_a), (b, kw_b))}
    points = [(f"decode b{n}", n, lambda t, n=n: t.decode(n, CONTEXT)) for n in AB_BATCHES] + \
        [("prefill 512", 512, lambda t: t.prefill(512))]
    got: dict = {name: {p[0]: [] for p in points} for name in llms}
    for _ in range(rounds):
        for name, llm in llms.items():
            timer = ModelTimer(llm)
            for label, tokens, make in points:
                got[name][label].append(tokens / median_time(make(timer), llm.device, repeats=5))
    rows = []
    for label, _, _ in points:
        ta, tb = (statistics.median(got[n][label]) for n in (a, b))
        rows.append({"point": label, f"{a}_tok_s": ta, f"{b}_tok_s": tb, "ratio": ta / tb})
    rows.append({"point": "MiB read a decode step", f"{a}_tok_s": llms[a].model.weight_bytes / 2**20,
                 f"{b}_tok_s": llms[b].model.weight_bytes / 2**20, "ratio": None})
    return rows


def print_ab(rows: list[dict]) -> None:
    a, b = [k[:-len("_tok_s")] for k in rows[0] if k.endswith("_tok_s")]
    print(f"{'point':>22}  {a + ' tok/s':>12}  {b + ' tok/s':>12}  {'ratio':>5}")
    for r in rows:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"{r['point']:>22}  {r[a + '_tok_s']:>12.1f}  {r[b + '_tok_s']:>12.1f}  {ratio:>5}")
