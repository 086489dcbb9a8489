"""Peer servers to measure agentserve against on the same machine and model:
vLLM's CPU build and llama.cpp (llama-cpp-python's server), plus agentserve
itself under two policies. See servers.py and README.md.

The names below are loaded from specs.py and running.py on first use, so
that importing this package (as `python -m agentserve.bench.peers.servers`
does) costs nothing."""

from __future__ import annotations

__all__ = ["DEFAULT_PORTS", "MODEL_NAME", "SERVER_NAMES", "PeerServerError", "RunningServer", "ServerSpec",
           "UnknownServerError", "kv_bytes_per_token", "server_spec", "server_specs", "start_server",
           "vllm_kvcache_space_gib"]


_RUNNING = ("RunningServer", "start_server")


def __getattr__(name: str):
    if name in _RUNNING:
        from agentserve.bench.peers import running
        return getattr(running, name)
    if name in __all__:
        from agentserve.bench.peers import specs
        return getattr(specs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
