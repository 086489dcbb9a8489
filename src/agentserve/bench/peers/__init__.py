"""Peer servers to measure agentserve against on the same machine and model:
vLLM's CPU build and llama.cpp (llama-cpp-python's server), plus agentserve
itself under other policies or as a cluster: each one's spec (specs.py), and
starting, waiting for, measuring in turn and stopping them (running.py).
Installing the peers and their command line: benchmarks/peers/README.md and
`python -m benchmarks peers` in the repository.

The names below are loaded from specs.py and running.py on first use."""

from __future__ import annotations

__all__ = ["DEFAULT_PORTS", "MODEL_NAME", "SERVER_NAMES", "PeerServerError", "RunningServer", "ServerSpec",
           "UnknownServerError", "each_server", "kv_bytes_per_token", "server_spec", "server_specs", "start_server",
           "vllm_kvcache_space_gib"]


_RUNNING = ("RunningServer", "each_server", "start_server")


def __getattr__(name: str):
    if name in _RUNNING:
        from agentserve.bench.peers import running
        return getattr(running, name)
    if name in __all__:
        from agentserve.bench.peers import specs
        return getattr(specs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
