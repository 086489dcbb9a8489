"""`agentserve cluster`: N engine replicas on Ray Serve behind one
OpenAI-compatible endpoint, routed by program (src/agentserve/router/).

Ray is an optional extra (`pip install 'agentserve[cluster]'`), imported only
when this command runs: `agentserve serve` and the rest never import it."""

from __future__ import annotations

import logging
import signal
import threading

from agentserve.cli_errors import CliError
from agentserve.cli_model import check_disk_args
from agentserve.cli_serve import (HelpFormatter, add_server_options, api_keys, build_server, check_serve_args,
                                  setup_logging)

log = logging.getLogger("agentserve")

ROUTERS = ("program", "pow2", "prefix", "round-robin", "ray-default")
INSTALL_HINT = "agentserve cluster needs Ray Serve, an optional extra: pip install 'agentserve[cluster]'"


def add_cluster(sub) -> None:
    p = sub.add_parser(
        "cluster", help="serve N engine replicas on Ray Serve behind one endpoint (program-aware routing)",
        description="Start a local Ray instance (or join one with --address) and serve N agentserve engine "
                    "replicas as a Ray Serve deployment behind one OpenAI-compatible endpoint: the same API, "
                    "errors and streaming as `agentserve serve` (each replica runs that server's app), with "
                    "GET /metrics merged from every replica under a `replica` label and GET /health ok when "
                    "every replica is. A program's turns go to the replica that holds its KV unless that "
                    "replica is overloaded; new programs are placed by free KV; requests without a program id "
                    "follow their prompt's prefix. Each replica takes --threads CPUs (default 1) and its share "
                    "of --kv-cache-tokens (the cluster's total). With --disk-kv-dir (and --disk-kv-bytes, the "
                    "cluster's total) the replicas share one disk KV directory: a finished turn's KV is written "
                    "there, and a program that moves to another replica reloads it instead of recomputing it. "
                    "A replica that dies is restarted by Ray; "
                    "requests it had not answered yet are retried on another replica, and a stream it had "
                    "begun ends with an error event. Needs `pip install 'agentserve[cluster]'`.",
        formatter_class=HelpFormatter)
    c = p.add_argument_group("cluster")
    c.add_argument("--replicas", type=int, default=2, help="engine replicas")
    c.add_argument("--address", default=None,
                   help="join this running Ray instance (e.g. 'auto' or 'ray://head:10001') instead of starting "
                        "a local one")
    c.add_argument("--router", default="program", choices=ROUTERS,
                   help="request routing: 'program' (agentserve's: program affinity with load escape, KV-load "
                        "placement, prefix-chain affinity for requests without an id); the baselines 'pow2' "
                        "(power of two choices by queue), 'prefix' (prefix-chain affinity only) and "
                        "'round-robin', all through the same request router; 'ray-default': Ray Serve's own "
                        "power-of-two-choices router")
    c.add_argument("--gpus-per-replica", type=float, default=0.0, metavar="G",
                   help="GPUs Ray gives each replica (e.g. 1, or 0.5 to share one); Ray names them in the "
                        "replica's CUDA_VISIBLE_DEVICES, so --device auto runs each replica on its own GPU "
                        "(0: CPU replicas)")
    c.add_argument("--tool-stats-interval", type=float, default=5.0, metavar="S",
                   help="seconds between a replica's exchanges of learned tool durations with the others "
                        "(merged in one place, each replica's TTL model then learns from every replica's tool "
                        "calls); 0: each replica learns alone")
    c.add_argument("--retries", type=int, default=2,
                   help="times a request whose replica failed before any output is retried on another one")
    add_server_options(p)
    p.set_defaults(func=cmd_cluster)


def cmd_cluster(args) -> int:
    try:
        import ray
        from ray import serve
    except ImportError:
        raise CliError(INSTALL_HINT) from None
    check_serve_args(args)
    if args.replicas < 1:
        raise CliError(f"--replicas must be at least 1, got {args.replicas}")
    if not 0 <= args.tool_stats_interval < float("inf"):
        raise CliError(f"--tool-stats-interval must be 0 (off) or a number of seconds, got {args.tool_stats_interval}")
    if args.retries < 0:
        raise CliError(f"--retries must be 0 or more, got {args.retries}")
    if args.threads is not None and args.threads < 1:
        raise CliError(f"--threads must be at least 1, got {args.threads}")
    if args.gpus_per_replica < 0:
        raise CliError(f"--gpus-per-replica must be 0 or more, got {args.gpus_per_replica:g}")
    if args.gpus_per_replica and args.device == "cpu":
        raise CliError("--gpus-per-replica with --device cpu: the replicas would hold GPUs they do not use")
    args.disk_kv_shared = args.disk_kv_shared or bool(args.disk_kv_dir)  # one directory: shared by all replicas
    check_disk_args(args)
    if args.disk_kv_bytes and args.disk_kv_bytes // args.replicas < 1:
        raise CliError(f"--disk-kv-bytes {args.disk_kv_bytes} gives no byte to each of {args.replicas} replicas")
    keys = api_keys(args)
    setup_logging(args)
    from agentserve.router import cluster_app

    started_ray = not ray.is_initialized() and args.address is None
    if not ray.is_initialized():
        ray.init(address=args.address, include_dashboard=False, logging_level=logging.WARNING)
    stop = threading.Event()
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        try:
            cluster_app.run(args, args.replicas, args.router, keys, build_replica_server, retries=args.retries)
        except RuntimeError as e:
            raise CliError(str(e)) from None
        share = (f"{args.kv_cache_tokens // args.replicas} KV tokens" if args.kv_cache_tokens
                 else "its share of the default KV cache")
        log.info("serving %d engine replicas on http://%s:%d/v1 - router %s; each replica: %d CPU thread(s), %s",
                 args.replicas, args.host, args.port, args.router, args.threads or 1, share)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        log.info("shutting down")
    finally:
        serve.shutdown()
        if started_ray:
            ray.shutdown()
    return 0


def build_replica_server(args, llm_factory=None):
    """One replica's server (in the replica's process): `agentserve serve`'s, from the flags
    `cluster_app.replica_args` gave it. Without --kv-cache-tokens, replicas on the CPU split the
    single server's default KV size between them."""
    setup_logging(args)
    split = getattr(args, "kv_cache_tokens_split", 0)
    if args.kv_cache_tokens is None and split:
        from agentserve.runner.device import CPU_DEFAULT_KV_TOKENS, resolve_device

        if resolve_device(args.device).type == "cpu":
            args.kv_cache_tokens = CPU_DEFAULT_KV_TOKENS // split
    return build_server(args, llm_factory)
