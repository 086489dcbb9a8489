"""Peer servers to measure agentserve against on the same machine and model:
vLLM's CPU build and llama.cpp's servers, plus agentserve itself under other
policies: each one's spec (specs.py), and starting, waiting for, measuring in
turn and stopping them (running.py). Installing the peers
and their command line: benchmarks/peers/README.md and `python -m benchmarks
peers` in the repository."""

from agentserve.bench.peers.running import RunningServer, each_server, start_server
from agentserve.bench.peers.specs import (DEFAULT_PORTS, MODEL_NAME, SERVER_NAMES, PeerServerError, ServerSpec,
                                          UnknownServerError, kv_bytes_per_token, server_spec, server_specs)

__all__ = ["DEFAULT_PORTS", "MODEL_NAME", "SERVER_NAMES", "PeerServerError", "RunningServer", "ServerSpec",
           "UnknownServerError", "each_server", "kv_bytes_per_token", "server_spec", "server_specs", "start_server"]
