"""One engine replica of `agentserve cluster`: the server `agentserve serve`
builds (cli_serve.build_server: the same LLM, engine thread and Starlette
app), driven in-process through asgi_bridge.py.

`build(args, llm_factory)` builds it: cli_cluster passes its
`build_replica_server` (the router layer never imports the command line).
The ingress calls `handle` with a request's method, path, query, headers and
body as a streaming call; the replica answers with the app's response head
(plus `X-Agentserve-Replica: <replica id>`) and then its body chunks, as the
app writes them. Ray calls `check_health` (the engine thread is alive) and
`record_routing_stats` (the replica's KV and queue load, `ReplicaLoad`, which
the request router reads). `probe` answers GET /metrics or /health for the
ingress's fan-out to every replica. With `--tool-stats-interval`, the replica
shares its tool statistics with the others' (shared_tools.py)."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from agentserve.router.asgi_bridge import AsgiBridge
from agentserve.router.shared_tools import find_hub, share_loop

log = logging.getLogger("agentserve.router")

REPLICA_HEADER = "x-agentserve-replica"


def state_name(context: Any) -> str:
    """The name of a replica's learned-state file: by its rank, which a replica that takes a
    dead one's place inherits (so it takes up what that one learned); by its id where Ray gives
    no rank."""
    rank = getattr(getattr(context, "rank", None), "rank", getattr(context, "rank", None))
    if isinstance(rank, int) and not isinstance(rank, bool):
        return f"replica-{rank}"
    return f"replica-{context.replica_id.unique_id}"


class EngineReplica:
    """A Ray Serve deployment class; `cluster_app.py` sets its options (replicas, CPUs, router)."""

    async def __init__(self, args: Any, build: Any, llm_factory: Any = None) -> None:
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        if getattr(args, "state_dir", None):  # each replica learns on its own: its own state file
            args = copy.copy(args)
            args.state_name = state_name(context)
        app, self.llm, self.config = build(args, llm_factory)
        self.bridge = AsgiBridge(app)
        await self.bridge.start()  # starts the engine loop on this replica's event loop
        self._share = None
        interval = getattr(args, "tool_stats_interval", 0)
        if interval > 0 and find_hub() is not None:
            self._share = asyncio.get_running_loop().create_task(share_loop(
                self.replica_id, self.bridge.app.state.server.engine, self.llm.scheduler.policy.tool_stats,
                self.llm.clock, interval))
        kv = self.llm.scheduler.kv
        log.info("replica %s ready: KV cache %d tokens (%d blocks of %d), policy %s", self.replica_id,
                 kv.num_blocks * kv.block_size, kv.num_blocks, kv.block_size, self.llm.scheduler.policy.name)

    async def handle(self, method: str, path: str, query: bytes, headers: list[tuple[str, str]], body: bytes,
                     route: Any = None, avoid: Any = None) -> AsyncIterator[Any]:
        """The app's response to the request: a head dict, then body chunks (`route` and `avoid`
        are for the request router only)."""
        async for message in self.bridge.request(method, path, query, headers, body):
            if isinstance(message, dict):
                message["headers"].append((REPLICA_HEADER, self.replica_id))
                message["replica"] = self.replica_id
            yield message

    async def probe(self, path: str, headers: list[tuple[str, str]]) -> tuple[str, int, bytes]:
        """(replica id, status, body) of GET `path` on this replica."""
        status, chunks = 500, []
        async for message in self.bridge.request("GET", path, b"", headers, b""):
            if isinstance(message, dict):
                status = message["status"]
            else:
                chunks.append(message)
        return self.replica_id, status, b"".join(chunks)

    def check_health(self) -> None:
        if not self.bridge.app.state.server.engine.alive:
            raise RuntimeError(f"replica {self.replica_id}: the engine is not running")

    def record_routing_stats(self) -> dict[str, Any]:
        from agentserve.router.replica_load import replica_load

        return replica_load(self.llm.engine, self.replica_id).to_dict()

    async def __del__(self) -> None:
        if self._share is not None:
            self._share.cancel()
        await self.bridge.stop()

