"""The Ray Serve application of `agentserve cluster`: N engine replicas
(replica.py) with agentserve's request router (ray_router.py), behind one
ingress (ingress.py); and starting it, or saying clearly why it did not start.

Each replica asks Ray for `--threads` CPUs (default 1), and for
`--gpus-per-replica` GPUs when given (Ray then names them in the replica's
CUDA_VISIBLE_DEVICES, so its `--device auto` is its own GPU), and gets its share of
the KV cache: `--kv-cache-tokens` is the cluster's total, split evenly (without
it, on the CPU, the single server's default is split). `--disk-kv-dir` is one
directory all replicas share (runner/shared_kv.py), `--disk-kv-bytes` the
cluster's total of it, split alike. Ray restarts a replica
whose actor dies or whose health check fails (the engine thread stopped)."""

from __future__ import annotations

import copy
import glob
import os
import time
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from agentserve.router.ingress import Ingress
from agentserve.router.ray_router import AgentserveRequestRouter
from agentserve.router.replica import EngineReplica
from agentserve.router.shared_tools import start_hub

APP_NAME = "agentserve"
REPLICA_DEPLOYMENT = "EngineReplica"
RAY_DEFAULT = "ray-default"  # Ray Serve's own power-of-two-choices router, for comparison
STATS_PERIOD_S = 0.5
POLL_S = 0.5  # how often the start checks the replicas' state
_hub: Any = None  # the tool statistics' hub actor (shared_tools.py)


def replica_args(args: Any, n: int) -> Any:
    """The flags one of `n` replicas is built with: its share of KV, its threads."""
    out = copy.copy(args)
    out.func = None  # the command, not needed (nor wanted) in the replica
    if args.kv_cache_tokens is not None:
        out.kv_cache_tokens = max(args.kv_cache_tokens // n, args.block_size)
    else:
        out.kv_cache_tokens_split = n  # the replica splits its device's default (cli_cluster.py)
    out.threads = args.threads or 1
    if getattr(args, "disk_kv_dir", None):  # one directory for all: shared, each its share of the bytes
        out.disk_kv_shared = True
        out.disk_kv_bytes = args.disk_kv_bytes // n
    return out


def actor_options(per: Any) -> dict[str, float]:
    """The Ray resources one replica asks for: its threads as CPUs, and its GPUs if any."""
    opts = {"num_cpus": per.threads}
    if getattr(per, "gpus_per_replica", 0):
        opts["num_gpus"] = per.gpus_per_replica
    return opts


def build_application(args: Any, n: int, router: str, api_keys: dict[str, str], build: Any,
                      llm_factory: Any = None, retries: int = 2):
    """The bound application: the ingress over `n` engine replicas routed by `router`, each
    replica's server made by `build(args, llm_factory)` (cli_cluster.build_replica_server)."""
    if router == RAY_DEFAULT:
        router_config = RequestRouterConfig(request_routing_stats_period_s=STATS_PERIOD_S)
    else:
        router_config = RequestRouterConfig(request_router_class=AgentserveRequestRouter,
                                            request_router_kwargs={"logic": router},
                                            request_routing_stats_period_s=STATS_PERIOD_S,
                                            request_routing_stats_timeout_s=5)
    per = replica_args(args, n)
    replicas = serve.deployment(
        EngineReplica, name=REPLICA_DEPLOYMENT, num_replicas=n,
        ray_actor_options=actor_options(per),
        # the replica's own queue limit (--max-queue) answers overload with a 503, as `serve` does
        max_ongoing_requests=(args.max_queue or 4096) + args.max_num_seqs,
        health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=args.graceful_shutdown_s,
        max_constructor_retry_count=2 * n,
        request_router_config=router_config,
    ).bind(per, build, llm_factory)
    ingress = serve.deployment(Ingress, name="Ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=1_000_000)
    return ingress.bind(replicas, api_keys, args.max_body_bytes, n, retries)


def replica_logs() -> list[str]:
    """This Ray session's replica log files of the engine deployment (newest last)."""
    import ray

    node = ray._private.worker._global_node  # noqa: SLF001 - the only way to the session's log dir
    if node is None:
        return []
    pattern = os.path.join(node.get_logs_dir_path(), "serve", f"replica_{APP_NAME}_{REPLICA_DEPLOYMENT}_*.log")
    return sorted(glob.glob(pattern), key=os.path.getmtime)


def start_failure(why: str) -> str:
    """One line that says why the replicas did not start, and where their log is."""
    first = _cause(why)
    logs = replica_logs()
    where = f"see the replica's log: {logs[-1]}" if logs else "see Ray's logs under /tmp/ray/session_latest/logs"
    return f"the engine replicas did not become healthy ({first[:300]}); {where}"


def _cause(message: str) -> str:
    """The telling line of Ray's deployment failure: the replica's own exception if it is there."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    errors = [ln for ln in lines if not ln.startswith(("File ", "Traceback", "^", "~")) and ": " in ln
              and ln.split(":", 1)[0].replace(".", "").isidentifier() and ln.split(":", 1)[0][0].isupper()]
    return errors[-1] if errors else (lines[0] if lines else "no reason given")


def run(args: Any, n: int, router: str, api_keys: dict[str, str], build: Any, llm_factory: Any = None,
        retries: int = 2, timeout_s: float = 600.0) -> None:
    """Deploy the application on the running Ray and wait until every replica is healthy.
    Raises RuntimeError with `start_failure`'s line when one never becomes healthy (its
    constructor failed twice per replica, or `timeout_s` passed)."""

    global _hub
    if getattr(args, "tool_stats_interval", 0) > 0:
        _hub = start_hub()  # held: the hub lives as long as this driver
    app = build_application(args, n, router, api_keys, build, llm_factory, retries)
    serve._run(app, name=APP_NAME, route_prefix="/", _blocking=False)
    for _ in range(max(1, round(timeout_s / POLL_S))):  # (polls, not the clock: router/ reads no clock)
        status = serve.status().applications.get(APP_NAME)
        state = getattr(status, "status", None)
        if state == "RUNNING":
            return
        if state in ("DEPLOY_FAILED", "UNHEALTHY"):
            replicas = status.deployments.get(REPLICA_DEPLOYMENT)
            raise RuntimeError(start_failure(getattr(replicas, "message", "") or status.message or state))
        time.sleep(POLL_S)
    raise RuntimeError(start_failure(f"not healthy after {timeout_s:.0f} s"))
