"""KV memory a long agent conversation holds between turns, full cache against
the hybrid cache (kv/window_parts.py), and how many such conversations one
`--kv-cache-tokens` budget retains each way.

It drives agentserve's own KV manager as the engine does (admission, chunked
prefill of each turn's delta, decoding, a pin at each turn's end), with the
pool sized from the model's own layers exactly as `agentserve serve` sizes
it, so the figures are the manager's accounting, not a formula. No model
weights are loaded: only the GGUF's header.

    python -m benchmarks kv-footprint --model gemma3-270m --tokens 32768
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.common import run_main, write_run_json


def model_shape(spec: str):
    """(ModelConfig, per-layer windows) of a GGUF, from its header."""
    from agentserve.runner import model_names
    from agentserve.runner.gguf_loader import config_from_metadata, open_gguf, read_metadata
    from agentserve.runner.tokenizer import Tokenizer

    entry = model_names.find(spec)
    path = entry.path() if entry is not None else spec
    reader = open_gguf(path)
    meta = read_metadata(reader)
    cfg = config_from_metadata(meta, {t.name: t for t in reader.tensors}, Tokenizer.from_gguf_metadata(meta))
    windows = [w if w is not None and w < cfg.max_position_embeddings else None
               for w in (cfg.layer_window(i) for i in range(cfg.num_layers))]
    return cfg, windows


def make_manager(cfg, windows, layout_name: str, kv_tokens: int, block_size: int):
    """The KV manager `agentserve serve` builds for this model, layout and budget."""
    from agentserve.kv.manager import KVCacheManager
    from agentserve.runner.kv_cache import kv_layout_for

    layout = kv_layout_for(layout_name, windows, disk=False)
    slots = cfg.num_layers if layout is None else layout.slots
    num_blocks = kv_tokens * cfg.num_layers // (slots * block_size)
    kv = KVCacheManager(num_blocks, block_size, window=layout and layout.window,
                        window_pages=layout.pages if layout else 0)
    return kv, slots


def converse(kv, pid: str, seed: int, tokens: int, turn_tokens: int, output_tokens: int, chunk: int,
             now: float) -> bool:
    """One program's conversation up to `tokens`, turn by turn, pinned at each
    turn's end; False if a turn did not fit."""
    history: list[int] = []
    base = 1_000_000 * (seed + 1)
    t = 0
    while len(history) < tokens:
        delta = min(turn_tokens - output_tokens, tokens - len(history) - output_tokens)
        prompt = history + [base + len(history) + i for i in range(max(1, delta))]
        m = kv.match(prompt)
        if pid in kv.pins:
            kv.unpin(pid, now)
        first = min(chunk, len(prompt) - m.num_tokens)
        st = kv.admit(m, first, now, len(prompt))
        if st is None:
            return False
        done = m.num_tokens
        while done < len(prompt) + output_tokens - 1:
            end = min(done + chunk, len(prompt)) if done < len(prompt) else done + 1
            if not kv.allocate_slots(st, end):
                kv.free(st, now)
                return False
            seq = prompt + [base + 500_000 + t * 10_000 + i for i in range(max(0, end - len(prompt)))]
            kv.commit(st, seq, end)
            done = end
        history = prompt + [base + 500_000 + t * 10_000 + i for i in range(output_tokens)]
        kv.pin(pid, st, now + 3600.0, 0.0, now)
        t += 1
        now += 1.0
    return True


def measure(args, layout_name: str, cfg, windows) -> dict:
    kv, slots = make_manager(cfg, windows, layout_name, args.kv_cache_tokens, args.block_size)
    page_bytes = cfg.kv_bytes_per_token(args.dtype_bytes) * args.block_size * slots // cfg.num_layers
    programs = 0
    per_program = None
    while converse(kv, f"p{programs}", programs, args.tokens, args.turn_tokens, args.output_tokens,
                   args.chunk, float(programs)):
        if per_program is None:
            per_program = kv.reclaimable_blocks("p0")
        programs += 1
        kv.check_integrity()
    if per_program is None:
        raise SystemExit(f"kv-footprint: one {args.tokens}-token conversation does not fit "
                         f"--kv-cache-tokens {args.kv_cache_tokens} with the {layout_name} layout")
    return {"layout": layout_name, "blocks": kv.num_blocks, "block_bytes": page_bytes,
            "program_blocks": per_program, "program_bytes": per_program * page_bytes,
            "programs_retained": programs, "pool_bytes": kv.num_blocks * page_bytes}


def run(args) -> int:
    cfg, windows = model_shape(args.model)
    rows = [measure(args, name, cfg, windows) for name in ("full", "hybrid")]
    n_window = sum(1 for w in windows if w is not None)
    print(f"{args.model}: {cfg.num_layers} layers ({n_window} with a {max(w or 0 for w in windows)}-token window), "
          f"a conversation of {args.tokens} tokens in turns of {args.turn_tokens} ({args.output_tokens} generated), "
          f"pinned between turns; KV budget --kv-cache-tokens {args.kv_cache_tokens} "
          f"({rows[0]['pool_bytes'] / 2**20:.0f} MiB at {args.dtype_bytes} bytes a value)")
    print(f"{'layout':<8} {'KV per program':>15} {'programs retained':>18}")
    for r in rows:
        print(f"{r['layout']:<8} {r['program_bytes'] / 2**20:>11.1f} MiB {r['programs_retained']:>18}")
    full, hyb = rows
    print(f"hybrid/full: {full['program_bytes'] / hyb['program_bytes']:.2f}x less KV a program, "
          f"{hyb['programs_retained'] / max(1, full['programs_retained']):.2f}x the programs")
    if args.json:
        write_run_json(args, rows, args.json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks kv-footprint", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python -m benchmarks kv-footprint --model gemma3-270m --tokens 32768\n"
               "  python -m benchmarks kv-footprint --model gemma3-270m --kv-cache-tokens 262144 --json fp.json")
    p.add_argument("--model", default="gemma3-270m", help="a short name or a GGUF path (its header is read)")
    p.add_argument("--tokens", type=int, default=32768, help="the conversation's length at its last turn")
    p.add_argument("--turn-tokens", type=int, default=2048, help="tokens each turn adds (its delta and output)")
    p.add_argument("--output-tokens", type=int, default=256, help="tokens each turn generates")
    p.add_argument("--kv-cache-tokens", type=int, default=131072, help="the KV budget, as --kv-cache-tokens")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (the engine's --max-num-batched-tokens)")
    p.add_argument("--dtype-bytes", type=int, default=2, help="bytes a KV value takes (2: bf16, 4: float32)")
    p.add_argument("--json", default=None, help="write the rows here")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
