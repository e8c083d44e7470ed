"""`SessionKVRouter`: Ray Serve's custom request router, running our pure policy.

Ray Serve calls `choose_replicas` for each request a handle sends to the
engine deployment (from the ingress, which put a `RoutedRequest` carrying a
`RouteKey` in the call's first argument). We turn the live replicas into
`ReplicaLoad`s (queue depth from Serve's queue-length cache and our own count
of requests in flight; free KV blocks and parked sessions from the replica's
`record_routing_stats`), ask `policy.choose_replica`, and return the choice
first and the rest, least loaded first, as fallbacks (Serve takes a later rank
only if the earlier one refuses, e.g. when its queue is full).

The router lives in the ingress process; its counters are read there
(`stats.router_for`) for /router/stats and /router/metrics. Serve pickles this
module by value into that process, so it keeps no module state of its own.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from sessionserve.router import policy as pol
from sessionserve.router.policy import PolicyConfig, ReplicaLoad, RouteDecision, RouteKey, RouteReason
from sessionserve.router.stats import RouterStats, register_router

logger = logging.getLogger(__name__)


def route_key_of(pending_request: PendingRequest | None) -> RouteKey:
    if pending_request is None or not pending_request.args:
        return RouteKey()
    key = getattr(pending_request.args[0], "route", None)
    return key if isinstance(key, RouteKey) else RouteKey()


class SessionKVRouter(RequestRouter):
    """Session affinity, then longest cached prefix, then least loaded (see `router.policy`).

    `mode="sticky"` or `"prefix"` runs a baseline policy instead (consistent hashing on the session id;
    longest prefix alone), with the same bookkeeping and counters.
    """

    def initialize_state(self, mode: str = "session_kv", **kwargs: Any) -> None:
        if mode not in ("session_kv", *pol.BASELINES):
            raise ValueError(f"unknown router mode {mode!r}")
        self.mode = mode
        self.policy_config = PolicyConfig(**kwargs)
        self.state = pol.RouterState.create(self.policy_config)
        self.stats = RouterStats()
        self._in_flight: Counter = Counter()  # replica id -> requests this router sent that have not completed
        self._request_replica: dict[str, str] = {}  # internal request id -> replica id (for completion)
        self._decisions: dict[str, RouteDecision] = {}  # internal request id -> last decision, until routed
        register_router(self._deployment_id.name, self)

    def _load(self, r: RunningReplica) -> ReplicaLoad:
        rid = r.replica_id.unique_id
        stats = r.routing_stats or {}
        cached = self.replica_queue_len_cache.get(r.replica_id)
        return ReplicaLoad(rid, num_queued=max(cached or 0, self._in_flight[rid]),
                           max_queued=r.max_ongoing_requests,
                           num_free_blocks=stats.get("num_free_blocks"), num_total_blocks=stats.get("num_total_blocks"),
                           num_parked_sessions=stats.get("num_parked_sessions", 0))

    def decide(self, key: RouteKey, candidates: list[RunningReplica]) -> RouteDecision | None:
        return pol.decide(self.mode, key, [self._load(r) for r in candidates], self.state, self.policy_config)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = route_key_of(pending_request)
        loads = [self._load(r) for r in candidate_replicas]
        decision = pol.decide(self.mode, key, loads, self.state, self.policy_config)
        if decision is None:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if pending_request is not None:
            self._decisions[pending_request.metadata.internal_request_id] = decision
        rest = [by_id[i] for i in pol.ranked_fallbacks(decision, loads, self.policy_config)]
        return [[by_id[decision.replica_id]]] + ([rest] if rest else [])

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        key = route_key_of(pending_request)
        rid = replica_id.unique_id
        decision = self._decisions.pop(pending_request.metadata.internal_request_id, None)
        self._count(key, rid, decision)
        pol.apply(self.state, key, rid)
        self._in_flight[rid] += 1
        self._request_replica[pending_request.metadata.internal_request_id] = rid

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._request_replica.pop(internal_request_id, replica_id.unique_id)
        if self._in_flight[rid] > 0:
            self._in_flight[rid] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        rid = replica_id.unique_id
        if rid not in self.stats.dead_replicas:
            self.stats.dead_replicas.append(rid)
        pol.forget_replica(self.state, rid)
        self._in_flight.pop(rid, None)

    def _count(self, key: RouteKey, rid: str, decision: RouteDecision | None) -> None:
        st = self.stats
        # Serve may pick a fallback rank; what counts is where the request went.
        reason = decision.reason if decision is not None and decision.replica_id == rid else RouteReason.LEAST_LOADED
        st.decisions[reason.value] += 1
        if key.session_key is not None:
            st.num_session_requests += 1
            home = key.owner or self.state.affinity.get(key.session_key)
            if key.is_released:
                st.num_migrations += 1  # its replica drained and let it go
            elif home is None or home == rid:
                st.num_affinity_hits += 1  # first step of a session has nowhere else to be
            elif reason is RouteReason.FAILOVER or home in st.dead_replicas:
                st.num_failovers += 1
            else:
                st.num_migrations += 1
        n = self.state.index.num_matched(rid, key.block_hashes)
        if n:
            st.num_prefix_hits += 1
            st.num_matched_blocks += n
