"""`python -m agentserve.integrations.vllm serve MODEL [--policy SPEC] [vLLM's serve options]`:
vLLM's own `vllm serve` with agentserve's scheduler, after checking what it can
before vLLM spends a minute starting (the vLLM version, the policy spec), with
the plugin's Prometheus series exported beside vLLM's."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from agentserve.integrations.vllm import QUALNAME
from agentserve.integrations.vllm.versions import supported_text, version_problem

EXAMPLE = ("python -m agentserve.integrations.vllm serve Qwen/Qwen3-8B --policy agentserve "
           "--gpu-memory-utilization 0.9 --port 8000")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m agentserve.integrations.vllm",
        description=f"Run vLLM ({supported_text()}) with agentserve's program scheduler: TTL retention of a "
                    "program's KV across tool calls and program order, inside vLLM. Every option that is not "
                    "listed here goes to `vllm serve` unchanged.",
        epilog=f"example: {EXAMPLE}")
    p.add_argument("command", choices=["serve"], help="the vLLM command (serve)")
    p.add_argument("model", help="the model, as `vllm serve` takes it")
    p.add_argument("--policy", default="agentserve",
                   help="the scheduling policy, with options as `agentserve serve --policy` takes them "
                        "(default: agentserve; e.g. agentserve:prefetch=off, continuum, vllm-fcfs)")
    p.add_argument("--max-pinned-share", type=float, default=0.9,
                   help="the share of vLLM's KV blocks that held programs may take at most (default 0.9)")
    return p


def main(argv: list[str] | None = None) -> int:
    args, rest = parser().parse_known_args(argv)
    problem = version_problem()
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from agentserve.policy.registry import parse_policy_spec

    try:
        parse_policy_spec(args.policy)
    except ValueError as e:
        print(f"error: --policy: {e}", file=sys.stderr)
        return 2
    if not 0.0 < args.max_pinned_share <= 1.0:
        print(f"error: --max-pinned-share must be in (0, 1], got {args.max_pinned_share}", file=sys.stderr)
        return 2
    if any(a == "--scheduler-cls" or a.startswith("--scheduler-cls=") for a in rest):
        print("error: --scheduler-cls is set by this command; run `vllm serve` itself to choose another",
              file=sys.stderr)
        return 2
    env = dict(os.environ, AGENTSERVE_POLICY=args.policy, AGENTSERVE_MAX_PINNED_SHARE=str(args.max_pinned_share))
    metrics_dir = None
    if "PROMETHEUS_MULTIPROC_DIR" not in env:  # the engine process's series reach /metrics only this way
        metrics_dir = env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="agentserve-vllm-metrics-")
    # the API server's module, not the `vllm` CLI: the CPU build's CLI looks itself up as "vllm" and fails
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
           "--scheduler-cls", QUALNAME, *rest]
    proc = subprocess.Popen(cmd, env=env)
    stop = lambda signum, frame: proc.send_signal(signum)  # noqa: E731  (vLLM shuts down on its own)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        return proc.wait()
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
