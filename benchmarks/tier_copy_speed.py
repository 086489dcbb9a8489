"""Host-tier copy bandwidth: `python -m benchmarks tier-copy-speed`.

Offloads and reloads N KV blocks between the device cache and the host tier
through the runner's own copies (runner/kv_cache.py write_host / read_host:
from a GPU one copy per run of consecutive slots, on the CPU one indexed copy),
into consecutive host slots and into a random permutation of them, medians of
repeats; beside them the earlier path (host slots head-major like the device
tensor, copied by indexing through a pageable bounce), the baseline the
block-major host tier replaced. Blocks of a model's KV shape (`--shape`, one of
runner/random_model.py's); on CUDA the host tier is pinned, as the server
makes it. Prints a table and writes JSON."""

from __future__ import annotations

import argparse
import json
import sys


def print_table(res: dict) -> None:
    print(f"host-tier copies, GB/s: {res['blocks']} blocks of {res['shape']} ({res['block_bytes'] / 2**20:.2f} MiB "
          f"each) on {res['device']}, medians of {res['repeats']}; round trip exact: {res['exact']}")
    cols = ["offload consecutive", "offload scattered", "reload consecutive", "reload scattered"]
    print("| path | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for r in res["rows"]:
        print(f"| {r['path']} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + " |")


def main(argv: list[str] | None = None) -> int:
    from agentserve.runner.random_model import SHAPES

    ap = argparse.ArgumentParser(prog="python -m benchmarks tier-copy-speed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto (CUDA when available)")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES),
                    help="the KV shape (default: llama3.1-8b on CUDA, smollm2-135m on the CPU)")
    ap.add_argument("--blocks", type=int, default=256, help="blocks copied each way (16 tokens each)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.blocks < 1 or args.repeats < 1:
        print("tier_copy_speed: --blocks and --repeats must be >= 1", file=sys.stderr)
        return 2
    from agentserve.runner.device import resolve_device

    try:
        dev = resolve_device(args.device)
    except ValueError as e:
        print(f"tier_copy_speed: {e}", file=sys.stderr)
        return 2
    shape = args.shape or ("llama3.1-8b" if dev.type == "cuda" else "smollm2-135m")
    from agentserve.runner.tier_speed import tier_copy_speed

    res = tier_copy_speed(str(dev), shape, args.blocks, repeats=args.repeats)
    print_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
