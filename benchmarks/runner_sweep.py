"""`runner_speed --sweep`: the real runner against context length, in one
dtype: decode tokens/s at each batch size and context beside its memory
roofline, a long prompt prefilled in chunks, one mixed step (decodes plus a
prefill chunk), and with peers the same shapes through their OpenAI API
(peer_speed.py). See runner_speed.py's module doc for the shapes."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from agentserve.text_table import aligned

SWEEP_CONTEXTS = (512, 2048, 4096, 8192)
SWEEP_BATCHES = (1, 8)
SWEEP_PREFILL = 8192
SWEEP_CHUNK = 2048  # max_num_batched_tokens of the chunked prefill (the server's default is 512)
SWEEP_MIXED = (8, 4096, 2048, 2048)  # decodes, their context, prefill chunk, its prefix
PEER_NEW_TOKENS = 128
KV_SLACK_TOKENS = 1024
KV_TOKENS_MULTIPLE = 256  # so that every peer holds exactly that many (agentserve/bench/peers/specs.py)


@dataclass
class SweepConfig:
    contexts: Sequence[int] = SWEEP_CONTEXTS
    batches: Sequence[int] = SWEEP_BATCHES
    prefill_tokens: int | Sequence[int] = (SWEEP_PREFILL,)  # each prompt prefilled in chunks (an int: one)
    chunk: int = SWEEP_CHUNK
    mixed: tuple[int, int, int, int] = SWEEP_MIXED
    kv_tokens: int | None = None  # None: sweep_kv_tokens
    peers: Sequence[str] = ()
    peer_new_tokens: int = PEER_NEW_TOKENS
    vllm_reserved_cpus: int | None = 0
    repeats: int = 3
    block_size: int = 16
    peer_model: str = "smollm2"  # the short name every peer serves (bench/peers/specs.py MODELS)
    slots: int = 8  # llama-server's --parallel

    def __post_init__(self) -> None:
        if not self.contexts or not self.batches or min(*self.contexts, *self.batches) < 1:
            raise ValueError("contexts and batches must be non-empty lists of positive integers")
        if isinstance(self.prefill_tokens, int):
            self.prefill_tokens = (self.prefill_tokens,)
        self.prefill_tokens = tuple(self.prefill_tokens)
        if not self.prefill_tokens or min(self.prefill_tokens) < 1 or self.chunk < 1:
            raise ValueError("prefill tokens and chunk must be >= 1")
        d, ctx, chunk, prefix = self.mixed
        if d < 0 or ctx < 1 or chunk < 1 or prefix < 0:
            raise ValueError(f"mixed: decodes >= 0, context >= 1, chunk >= 1, prefix >= 0; got {self.mixed}")
        if self.peer_new_tokens < 2:
            raise ValueError("peer new tokens must be >= 2 (decode is timed after the first token)")
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")
        if self.kv_tokens is None:
            self.kv_tokens = sweep_kv_tokens(self)
        elif self.peers and self.kv_tokens % KV_TOKENS_MULTIPLE:
            raise ValueError(f"--kv-tokens must be a multiple of {KV_TOKENS_MULTIPLE} when peers run")


def parse_mixed(text: str) -> tuple[int, int, int, int]:
    """'8,4096,2048,2048' -> (decodes, context, chunk, prefix)."""
    try:
        vals = tuple(int(x) for x in text.split(","))
    except ValueError:
        vals = ()
    if len(vals) != 4:
        raise argparse.ArgumentTypeError(f"expected DECODES,CONTEXT,CHUNK,PREFIX (four integers), got {text!r}")
    return vals  # type: ignore[return-value]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def sweep_kv_tokens(cfg: SweepConfig) -> int:
    """KV tokens that hold every shape of the sweep at once (agentserve's block
    tables are laid side by side; a peer holds B prompts plus their new tokens),
    with slack, rounded up to a multiple of 256 so every peer gets exactly that."""
    bs = cfg.block_size
    d, ctx, chunk, prefix = cfg.mixed
    need = max(max(cfg.batches) * _round_up(max(cfg.contexts), bs),
               d * _round_up(ctx, bs) + _round_up(prefix + chunk, bs),
               _round_up(max(cfg.prefill_tokens), bs),
               max(cfg.batches) * (max(cfg.contexts) + cfg.peer_new_tokens))
    return _round_up(need + KV_SLACK_TOKENS, KV_TOKENS_MULTIPLE)


def kv_read_bytes(rows: int, context: int, layers: int, kv_heads: int, head_dim: int, elt: int,
                  windows: Sequence[int | None] | None = None) -> int:
    """K and V a decode step reads: rows x context x layers x 2 x kv_heads x head_dim x element size;
    with `windows` (per layer: its sliding window, None for a global layer) a window layer reads
    min(context, window) positions (Gemma 3: 15 of 18 layers read 512 at most)."""
    positions = layers * context if windows is None else sum(context if w is None else min(context, w)
                                                             for w in windows)
    return rows * positions * 2 * kv_heads * head_dim * elt


def decode_roofline(weight_bytes: int, rows: int, context: int, layers: int, kv_heads: int, head_dim: int,
                    elt: int, bandwidth: float, windows: Sequence[int | None] | None = None) -> dict:
    """The memory roofline of a decode step: the bytes it must read (every
    weight once, every row's KV within each layer's window) over the read bandwidth in bytes/s."""
    total = weight_bytes + kv_read_bytes(rows, context, layers, kv_heads, head_dim, elt, windows)
    step = total / bandwidth
    return {"bytes": total, "step_s": step, "tok_s": rows / step}


def sweep_agentserve(model, dtype: str, cfg: SweepConfig, progress: Callable[[str], None] = lambda s: None,
                     bandwidth_gib: float = 1.0) -> dict:
    """The sweep's agentserve half: bare forward steps of `model` (a path,
    None for the default, or a LoadedModel) in `dtype`."""
    from agentserve.llm import LLM
    from agentserve.runner.profiling import ModelTimer, kv_element_size, median_time, read_bandwidth

    llm = LLM(model, dtype=dtype, kv_cache_tokens=cfg.kv_tokens, block_size=cfg.block_size,
              max_num_batched_tokens=cfg.chunk, max_num_seqs=max(cfg.batches), policy="vllm-fcfs")
    d, mctx, mchunk, mprefix = cfg.mixed
    too_long = [n for n in (*cfg.contexts, *cfg.prefill_tokens, mctx, mprefix + mchunk) if n > llm.max_model_len]
    if too_long:
        raise ValueError(f"{too_long} exceed the model's max_model_len {llm.max_model_len}")
    timer = ModelTimer(llm)
    mc = llm.config
    elt = kv_element_size(llm)
    windows = [mc.layer_window(i) for i in range(mc.num_layers)]
    out: dict = {"model": llm.model_source, "dtype": dtype, "device": str(llm.device),
                 "weight_bytes": llm.model.weight_bytes,
                 "weight_format": getattr(llm.model, "weight_format", dtype), "kv_element_bytes": elt,
                 "num_layers": mc.num_layers, "num_kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim,
                 "layer_windows": windows,
                 "kv_tokens": cfg.kv_tokens, "decode": []}
    # This VM's read bandwidth moves between moments (30-65 GB/s measured an hour apart), so each
    # decode point gets its own measurement taken right before it, and its roofline from that.
    bws = []
    for b in cfg.batches:
        for c in cfg.contexts:
            bw = read_bandwidth(llm.device, bandwidth_gib)
            bws.append(bw)
            # ModelTimer.decode(b, n) steps the (n+1)-th token: context c = position c - 1
            t = median_time(timer.decode(b, c - 1), llm.device, repeats=max(cfg.repeats, 5))
            roof = decode_roofline(out["weight_bytes"], b, c, mc.num_layers, mc.num_kv_heads, mc.head_dim, elt, bw,
                                   windows)
            out["decode"].append({"batch": b, "context": c, "step_s": t, "tok_s": b / t, "read_bandwidth_gb_s": bw / 1e9,
                                  "roofline_bytes": roof["bytes"], "roofline_tok_s": roof["tok_s"],
                                  "roofline_fraction": (b / t) / roof["tok_s"]})
            progress(f"decode b{b} @{c}: {t * 1e3:.1f} ms/step, {b / t:.1f} tok/s "
                     f"({100 * (b / t) / roof['tok_s']:.0f}% of the roofline at {bw / 1e9:.1f} GB/s)")
    out["read_bandwidth_gb_s"] = statistics.median(bws) / 1e9 if bws else read_bandwidth(llm.device, bandwidth_gib) / 1e9
    out["prefills"] = []
    for n in cfg.prefill_tokens:
        t = median_time(timer.chunked_prefill(n, cfg.chunk), llm.device, repeats=cfg.repeats)
        out["prefills"].append({"tokens": n, "chunk": cfg.chunk, "chunks": -(-n // cfg.chunk), "total_s": t,
                                "tok_s": n / t})
        progress(f"prefill {n} in chunks of {cfg.chunk}: {t:.2f} s, {n / t:.0f} tok/s")
    out["prefill"] = out["prefills"][0]  # the first prompt (the key older results have)
    t = median_time(timer.mixed(d, mctx, mchunk, mprefix), llm.device, repeats=cfg.repeats)
    out["mixed"] = {"decodes": d, "context": mctx, "chunk": mchunk, "prefix": mprefix, "step_s": t,
                    "tokens": d + mchunk, "tok_s": (d + mchunk) / t}
    progress(f"mixed {d} decodes @{mctx} + {mchunk} after {mprefix}: {t * 1e3:.0f} ms")
    return out


def run_sweep(model, dtype: str, cfg: SweepConfig, progress: Callable[[str], None] = lambda s: None,
              bandwidth_gib: float = 1.0) -> dict:
    """agentserve's bare steps, then each peer in turn (after agentserve's
    model and KV cache are freed)."""
    import gc

    result: dict = {"mode": "sweep", "config": asdict(cfg) | {"dtype": dtype}}
    result["agentserve"] = sweep_agentserve(model, dtype, cfg, progress, bandwidth_gib)
    gc.collect()
    result["peers"] = {}
    if cfg.peers:
        from agentserve.bench.peers.specs import server_specs
        from benchmarks.peer_speed import PeerSweep, measure_peers

        sweep = PeerSweep(cfg.contexts, cfg.batches, cfg.prefill_tokens, cfg.peer_new_tokens)
        result["config"]["peer_nonce"] = sweep.nonce
        specs = server_specs(cfg.peers, cfg.kv_tokens, model=cfg.peer_model, slots=cfg.slots,
                             vllm_reserved_cpus=cfg.vllm_reserved_cpus)
        result["peers"] = measure_peers(specs, sweep, progress)
    result["rows"] = sweep_rows(result)
    return result


def sweep_rows(result: dict) -> list[dict]:
    """One row per point: agentserve's figure, its step time, the roofline and
    the fraction of it (decode), and each peer's figure and agentserve's ratio to it."""
    a = result["agentserve"]
    peers = result.get("peers") or {}

    def peer_vals(get) -> dict:
        vals = {}
        for name, pr in peers.items():
            v = None if pr.get("error") else get(pr)
            vals[name] = v
        return vals

    rows = []
    for d in a["decode"]:
        def get(pr, d=d):
            hit = [r for r in pr.get("decode", ()) if r["batch"] == d["batch"] and r["context"] == d["context"]]
            return hit[0].get("tok_s") if hit else None
        rows.append({"point": f"decode b{d['batch']} @{d['context']}", "unit": "tok/s", "agentserve": d["tok_s"],
                     "ms": d["step_s"] * 1e3, "roofline": d["roofline_tok_s"], "fraction": d["roofline_fraction"],
                     "gb_s": d.get("read_bandwidth_gb_s"),
                     "peers": peer_vals(get)})
    for p in a.get("prefills") or [a["prefill"]]:
        def get(pr, n=p["tokens"]):
            hit = [q for q in pr.get("prefills") or [pr.get("prefill") or {}] if q.get("target", n) == n]
            return hit[0].get("tok_s") if hit else None
        rows.append({"point": f"prefill {p['tokens']} /{p['chunk']}", "unit": "tok/s", "agentserve": p["tok_s"],
                     "ms": p["total_s"] * 1e3, "roofline": None, "fraction": None, "gb_s": None,
                     "peers": peer_vals(get)})
    m = a["mixed"]
    rows.append({"point": f"mixed {m['decodes']}x@{m['context']} + {m['chunk']}@{m['prefix']}", "unit": "tok/s",
                 "agentserve": m["tok_s"], "ms": m["step_s"] * 1e3, "roofline": None, "fraction": None, "gb_s": None,
                 "peers": {name: None for name in peers}})
    for r in rows:
        r["ratios"] = {name: (r["agentserve"] / v if v else None) for name, v in r["peers"].items()}
    return rows


def _fmt(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def format_sweep(rows: list[dict]) -> str:
    """The sweep's table: ms is agentserve's step time (decode, mixed) or total time (prefill)."""
    names = list(rows[0]["peers"]) if rows else []
    head = ["point", "agentserve tok/s", "ms", "GB/s", "roofline tok/s", "of roofline"]
    for n in names:
        head += [n, f"x {n}"]
    lines = [head]
    for r in rows:
        line = [r["point"], _fmt(r["agentserve"], ".1f"), _fmt(r["ms"], ".1f"), _fmt(r.get("gb_s"), ".1f"),
                _fmt(r["roofline"], ".1f"),
                "-" if r["fraction"] is None else f"{100 * r['fraction']:.0f}%"]
        for n in names:
            line += [_fmt(r["peers"][n], ".1f"), _fmt(r["ratios"][n], ".2f")]
        lines.append(line)
    return aligned(lines, rule=False)


def peer_errors(result: dict) -> list[str]:
    return [f"{name}: {pr['error']}" for name, pr in (result.get("peers") or {}).items() if pr.get("error")]


def peer_model(model: str | None, peers: Sequence[str]) -> str:
    """The short name the peers serve: --model's, which must be one when peers run (a path
    to some file has no converted folder or known shape for them)."""
    from agentserve.bench.peers.specs import DEFAULT_MODEL, MODELS
    from agentserve.runner import model_names

    entry = model_names.find(model)
    if entry is not None and entry.name in MODELS:
        return entry.name
    if peers:
        raise ValueError(f"--peers needs --model as one of {', '.join(MODELS)} (every server serves that "
                         f"model's GGUF), not {model!r}")
    return DEFAULT_MODEL


def sweep_config(args) -> SweepConfig:
    from benchmarks.peer_speed import peer_names

    peers = peer_names(args.peers or "")
    return SweepConfig(contexts=args.contexts, batches=args.batches, prefill_tokens=args.prefill_tokens,
                       chunk=args.max_num_batched_tokens, mixed=args.mixed, kv_tokens=args.kv_tokens,
                       peers=peers, peer_new_tokens=args.peer_new_tokens,
                       vllm_reserved_cpus=args.vllm_reserved_cpus, repeats=args.repeats,
                       peer_model=peer_model(args.model, peers), slots=args.llama_server_slots)


def sweep_header(a: dict, kv_tokens: int) -> str:
    return (f"{a['model']} {a['dtype']} ({a.get('weight_format', a['dtype'])} weights, "
            f"{a['weight_bytes'] / 1e6:.0f} MB) on {a['device']}; read bandwidth {a['read_bandwidth_gb_s']:.1f} GB/s "
            f"(median; GB/s: measured right before each decode point, its roofline from that); "
            f"KV {kv_tokens} tokens; decode context C = the step's token is the C-th; peers: tok/s through their "
            f"API (decode: while the whole batch decodes)")


def main_sweep(args) -> int:
    dtypes = [d.strip() for d in (args.dtypes or "bfloat16").split(",") if d.strip()]
    if len(dtypes) != 1:
        print("error: --sweep measures one dtype", file=sys.stderr)
        return 2
    try:
        cfg = sweep_config(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = run_sweep(args.model, dtypes[0], cfg, progress=lambda s: print(s, file=sys.stderr, flush=True))
    except (ValueError, FileNotFoundError) as e:  # a model not installed, a shape past its context
        print(f"error: {e}", file=sys.stderr)
        return 2
    a = result["agentserve"]
    print(sweep_header(a, cfg.kv_tokens))
    print(format_sweep(result["rows"]))
    for line in peer_errors(result):
        print(f"peer failed: {line}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
