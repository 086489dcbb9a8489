"""`agentserve cluster` when a replica cannot start: a one-line error that names
the replica's log file, instead of a hang or a traceback. Its own local Ray
(about 20 s). Skipped without Ray."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("ray.serve")

from cluster_fixtures import free_port, local_ray  # noqa: E402


def broken_llm(args):
    raise FileNotFoundError("no model file at /nowhere/model.gguf")


def test_a_replica_that_never_starts_fails_with_its_log_named():
    import ray
    from ray import serve

    from agentserve.cli import build_parser
    from agentserve.cli_cluster import build_replica_server
    from agentserve.router import cluster_app

    args = build_parser().parse_args(["cluster", "--log-level", "warning"])
    local_ray()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        with pytest.raises(RuntimeError) as e:
            cluster_app.run(args, 1, "program", {}, build_replica_server, llm_factory=broken_llm, timeout_s=120)
        line = str(e.value)
        assert "\n" not in line and "did not become healthy" in line
        assert "no model file at /nowhere/model.gguf" in line, line
        log = line.rsplit("see the replica's log: ", 1)[1]
        assert os.path.exists(log) and "EngineReplica" in log
    finally:
        serve.shutdown()
        ray.shutdown()
