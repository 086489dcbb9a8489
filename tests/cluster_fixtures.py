"""A 2-replica `agentserve cluster` in-process for the cluster tests: a local
Ray (2 CPUs, no dashboard), Serve's HTTP proxy on a free loopback port, and
the tiny random Llama of tiny_models.py in every replica (`tiny_replica_llm`,
which the replicas import by name: tests/ and src/ go on their PYTHONPATH)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import httpx

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"


def tiny_replica_llm(args):
    """The replicas' model: the server tests' tiny Llama, served as 'tiny'."""
    from server_fixtures import tiny_llm

    return tiny_llm(kv_cache_tokens=args.kv_cache_tokens)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_ray() -> None:
    """A local Ray of 2 CPUs whose workers import agentserve and these test helpers."""
    import ray

    paths = [str(SRC), str(TESTS), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)  # (an empty entry breaks Ray's agents)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)


class Cluster:
    def __init__(self, replicas: int = 2, router: str = "program", extra: list[str] | None = None) -> None:
        self.replicas, self.router, self.extra = replicas, router, extra or []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> Cluster:
        from ray import serve

        from agentserve.cli import build_parser
        from agentserve.cli_cluster import build_replica_server
        from agentserve.router import cluster_app

        args = build_parser().parse_args(["cluster", "--served-model-name", "tiny", "tiny-alias",
                                          "--kv-cache-tokens", "8192", "--max-num-seqs", "8", "--log-level",
                                          "warning", "--max-body-bytes", str(64 * 1024), *self.extra])
        local_ray()
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        cluster_app.run(args, self.replicas, self.router, {}, build_replica_server, llm_factory=tiny_replica_llm)
        self.wait_healthy(60)
        return self

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the test cluster did not become healthy")

    def stop(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()

    def replica_actor(self, replica_id: str):
        import ray

        for a in ray.util.list_named_actors(all_namespaces=True):
            if a["name"].endswith(f"#{replica_id}") and "EngineReplica" in a["name"]:
                return ray.get_actor(a["name"], namespace=a["namespace"])
        raise LookupError(f"no actor for replica {replica_id}")


