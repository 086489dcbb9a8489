"""`python -m benchmarks cluster-compare`: `agentserve bench compare` with
`agentserve cluster` servers beside the others: `cluster-<router>` is a
cluster of CLUSTER_REPLICAS replicas behind that router (ray-default: Ray
Serve's own power-of-two-choices router), given the KV tokens and threads of
one server in all, split evenly over its replicas; each cluster's router
decisions from its /metrics page printed on stderr.

    python -m benchmarks cluster-compare --servers agentserve-agentserve,cluster-program,cluster-prefix \\
        --workload bfcl --programs 16 --rate 0.4 --token-scale 1.0 --kv-tokens 65536

takes every other option of `agentserve bench compare`; the docs' Scale-out
page, "Routers side by side, live"."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from collections.abc import Iterable
from pathlib import Path

from agentserve.bench.compare import add_compare_args, cmd_compare
from agentserve.bench.peers.kv_shape import AGENTSERVE_BLOCK_TOKENS
from agentserve.bench.peers.specs import ServerSpec, UnknownServerError, server_spec

from benchmarks.common import run_main

CLUSTER_ROUTERS = ("program", "ray-default", "pow2", "prefix", "round-robin")
CLUSTER_REPLICAS = 2
CLUSTER_NAMES = tuple(f"cluster-{r}" for r in CLUSTER_ROUTERS)
DEFAULT_PORTS = {name: 8120 + i for i, name in enumerate(CLUSTER_NAMES)}
STARTUP_TIMEOUT_S = 300.0
DEFAULT_SERVERS = ("agentserve-agentserve", "cluster-program", "cluster-ray-default", "cluster-prefix")


def cluster_spec(name: str, kv_tokens: int, *, port: int | None = None, threads: int = 2,
                 startup_timeout_s: float | None = None, extra_args: Iterable[str] = (), **kwargs) -> ServerSpec:
    """The spec of `agentserve cluster` named `name` (one of CLUSTER_NAMES): an agentserve server's
    (server_spec's other arguments), its command the cluster's."""
    if name not in CLUSTER_NAMES:
        raise UnknownServerError(f"unknown cluster {name!r}; choose from {', '.join(CLUSTER_NAMES)}")
    one = server_spec("agentserve-continuum", kv_tokens, port=DEFAULT_PORTS[name] if port is None else port,
                      threads=threads, startup_timeout_s=STARTUP_TIMEOUT_S if startup_timeout_s is None
                      else startup_timeout_s, **kwargs)
    per = max(1, threads // CLUSTER_REPLICAS)
    argv = (one.argv[0], "-m", "agentserve.cli", "cluster", "--replicas", str(CLUSTER_REPLICAS),
            "--router", name.removeprefix("cluster-"), "--model", one.model, "--kv-cache-tokens", str(kv_tokens),
            "--block-size", str(AGENTSERVE_BLOCK_TOKENS), "--max-model-len", str(one.max_model_len),
            "--threads", str(per), "--host", one.host, "--port", str(one.port),
            "--served-model-name", one.model_name, *extra_args)
    no_ray = importlib.util.find_spec("ray") is None
    return dataclasses.replace(
        one, name=name, argv=argv, log_path=one.log_path.with_name(f"{name}.log"),
        kv_setting=(f"--kv-cache-tokens {kv_tokens} in all: {CLUSTER_REPLICAS} replicas of "
                    f"{kv_tokens // CLUSTER_REPLICAS} tokens and {per} thread each"),
        requires=(Path("ray (the cluster extra)"),) if no_ray else (),
        install_hint="pip install 'agentserve[cluster]'" if no_ray else "")


def specs_of(names: Iterable[str], kv_tokens: int, **kwargs) -> list[ServerSpec]:
    """server_specs, with CLUSTER_NAMES too."""
    return [(cluster_spec if n.startswith("cluster-") else server_spec)(n, kv_tokens, **kwargs) for n in names]


def router_summary(metrics: str | None) -> str:
    """One line of a cluster's router decisions from its /metrics page ('' if none)."""
    found = []
    for line in (metrics or "").splitlines():
        if line.startswith("agentserve:router_counters{"):
            name = line.split('counter="', 1)[1].split('"', 1)[0]
            if name in ("affinity", "escapes", "prefix_matches", "placements", "fallbacks", "programs_lost"):
                found.append(f"{name} {float(line.rsplit(' ', 1)[1]):.0f}")
    return ", ".join(found)


def print_decisions(results: list[dict], rows: list[dict], lines: list[list[str]]) -> None:
    """compare's `widen`: each cluster's router decisions, on stderr."""
    for result in results:
        decisions = router_summary(result.get("final_metrics"))
        if decisions:
            print(f"{result['server']}: router decisions: {decisions}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks cluster-compare",
                                description=__doc__.split("\n\n")[0].replace(
                                    "`python -m benchmarks cluster-compare`: ", ""))
    add_compare_args(p, DEFAULT_SERVERS)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), lambda a: cmd_compare(a, specs_of, widen=print_decisions), argv)


if __name__ == "__main__":
    sys.exit(main())
