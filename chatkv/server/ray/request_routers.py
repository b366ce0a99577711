"""Ray Serve request routers for the engine replicas of ``chatkv serve --ray``.

``AffinityRouter`` is the policy of ``affinity.py`` (session, then longest cached prefix,
then least loaded; affinity yields past ``imbalance`` requests in flight) behind Ray
Serve's ``RequestRouter`` extension point (``RequestRouterConfig(request_router_class=...)``).
``RoundRobinRouter`` sends request n to replica n mod N: the baseline the tests and
``benchmarks/bench_ray_routing.py`` compare against (and a choice: ``--ray-routing``).

Where the knowledge comes from (details in ``affinity.py``): each router instance lives in
the process of the deployment handle that routes with it, the ingress replica; it shares one
``AffinityTable`` per deployment with that ingress (``affinity.table_for``; it lives there
and not here because Ray pickles this module by value into each router), which records every
answer (who answered which session and which prefix). Replicas' ``record_routing_stats``
reports reach ``update_replicas`` with Ray's replica list (``RunningReplica.routing_stats``)
and are merged into the table. Load is the requests this process has in flight on each
replica (``on_send_request`` / ``on_request_completed``) and those chosen for it and not yet
sent, or Ray's cached queue length when that is higher (other ingress replicas' load).
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from chatkv.server.ray.affinity import RouteKeys, choose, table_for


def keys_of(request: Optional[PendingRequest]) -> RouteKeys:
    """The ``RouteKeys`` the ingress passed as the call's second argument (none: route by load)."""
    if request is not None and request.args and len(request.args) > 1 and isinstance(request.args[1], RouteKeys):
        return request.args[1]
    return RouteKeys()


class _Loads:
    """Requests this process has sent and not yet seen completed, per replica, plus those chosen
    for it and not yet sent (requests routed at the same moment see each other's choice)."""

    def __init__(self):
        self.in_flight: Counter = Counter()
        self.chosen: Counter = Counter()

    def choose(self, rid: str) -> None:
        self.chosen[rid] += 1

    def sent(self, replica_id: ReplicaID) -> None:
        rid = replica_id.unique_id
        self.in_flight[rid] += 1
        if self.chosen[rid] > 0:
            self.chosen[rid] -= 1

    def load(self, rid: str) -> int:
        return self.in_flight[rid] + self.chosen[rid]

    def done(self, replica_id: ReplicaID) -> None:
        rid = replica_id.unique_id
        if self.in_flight[rid] > 0:
            self.in_flight[rid] -= 1


class AffinityRouter(RequestRouter):
    """Session and prefix-cache affinity; see the module docstring."""

    def initialize_state(self, deployment: str = "EngineReplica", imbalance: int = 8, **kwargs):
        self._table = table_for(deployment)
        self._imbalance = int(imbalance)
        self._loads = _Loads()

    def _load(self, replica: RunningReplica) -> int:
        cached = self._replica_queue_len_cache.get(replica.replica_id)
        return max(self._loads.load(replica.replica_id.unique_id), cached or 0)

    def update_replicas(self, replicas: List[RunningReplica]):
        super().update_replicas(replicas)
        self._table.set_replicas(r.replica_id.unique_id for r in replicas)
        for r in replicas:
            self._table.merge_report(r.replica_id.unique_id, r.routing_stats)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self._table.set_replicas(self._table.replicas - {replica_id.unique_id})

    def on_send_request(self, replica_id: ReplicaID):
        super().on_send_request(replica_id)
        self._loads.sent(replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str):
        self._loads.done(replica_id)

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {rid: self._load(r) for rid, r in by_id.items()}
        keys = keys_of(pending_request)
        ranks, reason = choose(keys, sorted(by_id), loads, self._table, self._imbalance)
        ctx = pending_request.routing_context if pending_request is not None else None
        if ctx is not None and not getattr(ctx, "chatkv_counted", False) and ranks:  # once per request
            ctx.chatkv_counted = True
            self._table.count(f"{keys.kind}:{reason}")
            self._loads.choose(ranks[0][0])
        return [[by_id[rid] for rid in rank] for rank in ranks]


class RoundRobinRouter(RequestRouter):
    """Request n goes to replica n mod N (sorted ids), the others as fallback ranks."""

    def initialize_state(self, deployment: str = "EngineReplica", **kwargs):
        self._table = table_for(deployment)
        self._turn = itertools.count()

    def update_replicas(self, replicas: List[RunningReplica]):
        super().update_replicas(replicas)
        self._table.set_replicas(r.replica_id.unique_id for r in replicas)

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        keys = keys_of(pending_request)
        if keys.pin is not None:
            pinned = [r for r in ordered if r.replica_id.unique_id == keys.pin]
            if pinned:
                return [pinned]
        i = next(self._turn) % len(ordered)
        self._table.count(f"{keys.kind}:round_robin")
        return [[r] for r in ordered[i:] + ordered[:i]]
