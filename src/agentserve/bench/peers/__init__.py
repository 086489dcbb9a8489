"""Peer servers to measure agentserve against on the same machine and model:
vLLM's CPU build and llama.cpp (llama-cpp-python's server), plus agentserve
itself under two policies. See servers.py and README.md.

The names below are loaded from servers.py on first use, so that
`python -m agentserve.bench.peers.servers` does not import it twice."""

from __future__ import annotations

__all__ = ["DEFAULT_PORTS", "MODEL_NAME", "SERVER_NAMES", "PeerServerError", "RunningServer", "ServerSpec",
           "UnknownServerError", "kv_bytes_per_token", "server_spec", "server_specs", "start_server",
           "vllm_kvcache_space_gib"]


def __getattr__(name: str):
    if name in __all__:
        from agentserve.bench.peers import servers
        return getattr(servers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
