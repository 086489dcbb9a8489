"""The Ray Serve request router of `agentserve cluster`: a `RequestRouter`
subclass that hands each decision to agentserve's routing logic.

Ray calls `choose_replicas` for every request the ingress sends to the
replicas' deployment. The ingress passes the request's `RouteKey` (program id,
prefix-chain keys, size hint: route_key.py) as the keyword argument `route`,
and on a retry the replicas already tried as `avoid`. Each replica reports its
load (`ReplicaLoad.to_dict()`) through `record_routing_stats`, which Ray hands
back here as `RunningReplica.routing_stats`. The logic (program_router.py, or
a baseline from baselines.py, picked by `request_router_kwargs["logic"]`)
ranks replica ids; they are mapped back to Ray's replicas, and every replica
the logic left out is added as a last rank so that Ray always has somewhere to
send the request. A replica's reported queue is raised to the requests Ray's
own queue-length cache says it runs now (fresher than the last report). The
logic hears where each request went (`routed`) and which replicas are gone
(`replica_gone`: a dead actor, or one the controller dropped), so a dead
replica's programs are placed afresh on their next turn."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from agentserve.router.replica_load import ReplicaLoad

log = logging.getLogger("agentserve.router")


def make_logic(name: str, options: dict[str, Any] | None = None):
    """The routing logic named `name` (registry.py: 'program' or a baseline); `options` are
    RouterConfig fields of the program router."""
    from agentserve.router.program_router import RouterConfig
    from agentserve.router.registry import make_router

    return make_router(name, config=RouterConfig(**options) if options else None)


def load_of(replica: RunningReplica, ongoing: int | None = None) -> ReplicaLoad:
    """What `replica` last reported (an empty healthy load before its first report), its queue
    raised to `ongoing`, the requests Ray knows it is running now: a report is up to a stats
    period old, and without this a burst of new programs would all be placed on the replica that
    looked least loaded when it last reported."""
    rid = replica.replica_id.unique_id
    stats = replica.routing_stats
    load = None
    if stats:
        try:
            load = ReplicaLoad.from_dict(stats)
        except ValueError:
            log.warning("replica %s reported malformed routing stats", rid, exc_info=True)
    if load is None or load.replica != rid:
        load = ReplicaLoad(replica=rid, total_blocks=0, free_blocks=0, pinned_blocks=0, waiting=0, running=0,
                           programs=frozenset(), healthy=True)
    if ongoing is not None and ongoing > load.queue:
        load = dataclasses.replace(load, waiting=ongoing - load.running)
    return load


class AgentserveRequestRouter(RequestRouter):
    """Ray's request router interface around agentserve's routing logic."""

    def initialize_state(self, logic: str = "program", options: dict[str, Any] | None = None, **kwargs) -> None:
        self.logic_name = logic
        self.logic = make_logic(logic, options)
        # Ray pickles this module by value into the ingress: its globals are a copy, so the
        # table the ingress reads for /metrics lives in ingress.py
        from agentserve.router.ingress import ROUTING_LOGIC

        ROUTING_LOGIC[self._deployment_id.name] = self.logic

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        avoid = set(kwargs.get("avoid") or ())
        candidates = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid] or candidate_replicas
        key = kwargs.get("route")
        if key is None:  # not a routed request (models, health): any replica
            return [candidates]
        by_id = {r.replica_id.unique_id: r for r in candidates}
        try:
            cache = self.replica_queue_len_cache
            ranked = self.logic.rank(key, [load_of(r, cache.get(r.replica_id)) for r in candidates])
        except Exception:  # a bug in the logic must not stop traffic: log it and let Ray choose
            log.exception("routing logic %s failed; routing by Ray's order", self.logic_name)
            return [candidates]
        ranks: list[list[RunningReplica]] = []
        seen: set[str] = set()
        for rank in ranked:
            row = [by_id[i] for i in rank if i in by_id and i not in seen]
            seen.update(r.replica_id.unique_id for r in row)
            if row:
                ranks.append(row)
        rest = [r for r in candidates if r.replica_id.unique_id not in seen]
        if rest:
            ranks.append(rest)
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        key = pending_request.kwargs.get("route")
        if key is not None:
            self.logic.routed(key, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.logic.replica_gone(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {r.unique_id for r in self.curr_replicas}
        super().update_replicas(replicas)
        for gone in before - {r.replica_id.unique_id for r in replicas}:
            self.logic.replica_gone(gone)
