"""The routing policy: which replica serves a request. Pure: state in, a `RouteDecision` out.

Order of preference, after Dynamo's KV router and Ray's prefix-affinity router:

1. **Affinity.** A session goes back to the replica that holds its KV (its
   owner in the session store, or where this router last sent it), unless
   that replica is overloaded and another is clearly not: then the session
   is *rebalanced* (it recomputes or restores there, and that replica owns it).
2. **Failover.** The owner is gone (dead or drained): pick as for a new
   request and say so, so the caller can count it.
3. **Longest cached prefix, weighed against load.** Among replicas that are
   not overloaded, the one with the lowest cost = blocks it would have to
   prefill (the prompt's blocks its cache, as this router fed it, lacks) +
   `queue_cost_blocks` x its requests in flight.
4. **Least loaded.** By a score of queue depth, used KV and parked sessions.

A session also leaves a home that is merely busier (not overloaded) when the
queue gap, priced the same way, exceeds what it would recompute elsewhere.

The baselines a practitioner would deploy live here too, so every router is
measured on the same code path: `sticky_replica` (consistent hashing of the
session id over the replicas, as a sticky-session load balancer does),
`longest_prefix_replica` (the replica believed to cache the longest prefix of
the prompt, ties to the least loaded, as vLLM's production-stack router does)
and `prefix_load_replica` (blocks to prefill weighed against requests in
flight, as llm-d's prefix and queue scorers do: step 3 above without
sessions). None of them knows sessions or parked KV.

The policy imports no Ray, no HTTP and no clock; `PrefixIndex` is the
router's own record of which block hashes it sent where (an approximation of
each replica's prefix cache, bounded per replica like the cache it mirrors).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum


class RouteReason(Enum):
    AFFINITY = "affinity"
    REBALANCE = "rebalance"
    FAILOVER = "failover"
    PREFIX = "prefix"
    LEAST_LOADED = "least_loaded"


@dataclass(frozen=True)
class RouteKey:
    """What the router knows of one request (computed by the ingress before routing)."""

    session_key: str | None = None  # tenant-namespaced session id, None for a sessionless request
    owner: str | None = None  # replica that holds the session's KV, per the session store
    block_hashes: tuple[bytes, ...] = ()  # chained hashes of the prompt's full KV blocks (tenant-salted)
    is_released: bool = False  # the store says its owner let it go (drained): route it as new


@dataclass(frozen=True)
class ReplicaLoad:
    """One live replica as the router sees it. Missing numbers count as idle."""

    replica_id: str
    num_queued: int = 0  # requests in flight on the replica (the router's queue-length view)
    max_queued: int = 64  # what the replica accepts before it is full
    num_free_blocks: int | None = None  # free device KV blocks, from the replica's routing stats
    num_total_blocks: int | None = None
    num_parked_sessions: int = 0  # sessions resident there but waiting on tools


@dataclass(frozen=True)
class PolicyConfig:
    overload_queue_frac: float = 0.8  # a replica with num_queued >= this * max_queued is overloaded
    overload_min_free_kv_frac: float = 0.02  # ... or with less than this fraction of its KV free
    rebalance_margin: float = 0.3  # move off an overloaded home only if another replica scores this much lower
    # NOTE: the exchange rate between load and cache, as in Dynamo's KV router (cost = blocks to prefill +
    # weight x load): one more request in flight on a replica is worth this many KV blocks of prefill.
    queue_cost_blocks: float = 4.0
    min_rebalance_queue_gap: int = 2  # a session leaves a busier home only past this queue gap (no flapping)
    min_prefix_blocks: int = 1  # a match shorter than this is no match
    weight_queue: float = 1.0  # score = w_q * queue_frac + w_kv * used_kv_frac + w_p * parked_frac
    weight_kv: float = 0.5
    weight_parked: float = 0.1
    max_index_blocks: int = 65536  # per replica, in the prefix index (an LRU)

    def __post_init__(self) -> None:
        if not 0 < self.overload_queue_frac <= 1:
            raise ValueError("overload_queue_frac must be in (0, 1]")
        if self.max_index_blocks < 1 or self.min_prefix_blocks < 1:
            raise ValueError("max_index_blocks and min_prefix_blocks must be >= 1")


@dataclass(frozen=True)
class RouteDecision:
    replica_id: str
    reason: RouteReason
    num_matched_blocks: int = 0  # leading prompt blocks the chosen replica is believed to cache
    previous_owner: str | None = None  # set when a session moves (rebalance, failover)


class PrefixIndex:
    """Per replica: an LRU of block hashes this router sent there. Mutated only by `record`/`forget`."""

    def __init__(self, max_blocks_per_replica: int) -> None:
        self.max_blocks = max_blocks_per_replica
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}

    def num_matched(self, replica_id: str, hashes: Sequence[bytes]) -> int:
        """Leading blocks of `hashes` that `replica_id` is believed to hold. Reads only."""
        blocks = self._blocks.get(replica_id)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def record(self, replica_id: str, hashes: Sequence[bytes]) -> None:
        blocks = self._blocks.setdefault(replica_id, OrderedDict())
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def forget(self, replica_id: str) -> None:
        self._blocks.pop(replica_id, None)

    def num_blocks(self, replica_id: str) -> int:
        return len(self._blocks.get(replica_id, ()))


@dataclass
class RouterState:
    """What the router remembers between requests; `apply` is its only writer."""

    index: PrefixIndex
    affinity: dict[str, str] = field(default_factory=dict)  # session key -> last replica routed to
    num_sessions: dict[str, int] = field(default_factory=dict)  # replica -> sessions in `affinity` (tie-break)

    @classmethod
    def create(cls, config: PolicyConfig) -> RouterState:
        return cls(PrefixIndex(config.max_index_blocks))


def load_score(r: ReplicaLoad, config: PolicyConfig) -> float:
    """Lower is better: weighted queue fill, KV fill and parked-session count."""
    queue_frac = r.num_queued / max(1, r.max_queued)
    kv_frac = 0.0
    if r.num_total_blocks:
        num_free = r.num_free_blocks if r.num_free_blocks is not None else r.num_total_blocks
        kv_frac = 1.0 - num_free / r.num_total_blocks
    parked_frac = r.num_parked_sessions / (r.num_parked_sessions + 16)  # saturating: a few parked barely count
    return config.weight_queue * queue_frac + config.weight_kv * kv_frac + config.weight_parked * parked_frac


def is_overloaded(r: ReplicaLoad, config: PolicyConfig) -> bool:
    if r.num_queued >= config.overload_queue_frac * r.max_queued:
        return True
    if r.num_total_blocks and r.num_free_blocks is not None:
        return r.num_free_blocks < config.overload_min_free_kv_frac * r.num_total_blocks
    return False


def choose_replica(key: RouteKey, replicas: Sequence[ReplicaLoad], state: RouterState,
                   config: PolicyConfig) -> RouteDecision | None:
    """The replica for one request, or None when there is no live replica. Reads `state` only."""
    if not replicas:
        return None
    by_id = {r.replica_id: r for r in replicas}
    # Ties go to the replica with fewer sessions, then the lower id: equal replicas share new sessions.
    ranked = sorted(replicas, key=lambda r: (load_score(r, config), state.num_sessions.get(r.replica_id, 0),
                                             r.replica_id))
    least = ranked[0]
    owner = key.owner
    if owner is None and key.session_key is not None and not key.is_released:
        owner = state.affinity.get(key.session_key)
    if owner is not None and owner in by_id:
        home = by_id[owner]
        if is_overloaded(home, config) and not is_overloaded(least, config) and \
                load_score(least, config) + config.rebalance_margin < load_score(home, config):
            return RouteDecision(least.replica_id, RouteReason.REBALANCE,
                                 state.index.num_matched(least.replica_id, key.block_hashes), previous_owner=owner)
        idle = min(replicas, key=lambda r: (r.num_queued, load_score(r, config), r.replica_id))
        gap = home.num_queued - idle.num_queued
        if gap >= config.min_rebalance_queue_gap and not is_overloaded(idle, config):
            recompute_blocks = len(key.block_hashes) - state.index.num_matched(idle.replica_id, key.block_hashes)
            if gap * config.queue_cost_blocks > recompute_blocks:
                return RouteDecision(idle.replica_id, RouteReason.REBALANCE,
                                     len(key.block_hashes) - recompute_blocks, previous_owner=owner)
        return RouteDecision(owner, RouteReason.AFFINITY, state.index.num_matched(owner, key.block_hashes))
    fresh = _choose_fresh(key, ranked, state, config)
    if owner is not None:  # the session had a home that is gone
        return RouteDecision(fresh.replica_id, RouteReason.FAILOVER, fresh.num_matched_blocks, previous_owner=owner)
    return fresh


def _choose_fresh(key: RouteKey, ranked: list[ReplicaLoad], state: RouterState,
                  config: PolicyConfig) -> RouteDecision:
    least = ranked[0]
    best, best_cost, best_n = least, None, 0
    for r in ranked:  # least loaded first, so it wins ties
        if is_overloaded(r, config):
            continue
        n = state.index.num_matched(r.replica_id, key.block_hashes)
        cost = (len(key.block_hashes) - n) + config.queue_cost_blocks * r.num_queued
        if best_cost is None or cost < best_cost:
            best, best_cost, best_n = r, cost, n
    if best_n >= config.min_prefix_blocks:
        return RouteDecision(best.replica_id, RouteReason.PREFIX, best_n)
    return RouteDecision(best.replica_id, RouteReason.LEAST_LOADED, best_n)


BASELINES = ("sticky", "prefix", "prefix-load")


def sticky_replica(key: RouteKey, replicas: Sequence[ReplicaLoad]) -> RouteDecision | None:
    """Consistent hashing on the session id (rendezvous: the replica with the highest hash of id + session
    wins, so a replica leaving moves only its own sessions). A request without a session goes to the
    replica with the fewest requests in flight."""
    if not replicas:
        return None
    if key.session_key is None:
        least = min(replicas, key=lambda r: (r.num_queued, r.replica_id))
        return RouteDecision(least.replica_id, RouteReason.LEAST_LOADED)

    def weight(r: ReplicaLoad) -> bytes:
        return hashlib.blake2b(f"{r.replica_id}\0{key.session_key}".encode(), digest_size=8).digest()

    return RouteDecision(max(replicas, key=weight).replica_id, RouteReason.AFFINITY)


def longest_prefix_replica(key: RouteKey, replicas: Sequence[ReplicaLoad],
                           state: RouterState) -> RouteDecision | None:
    """The replica this router sent the longest leading run of the prompt's blocks to; ties (and no match)
    to the fewest requests in flight. Sessions and the replicas' KV use are not looked at."""
    if not replicas:
        return None
    best = min(replicas, key=lambda r: (-state.index.num_matched(r.replica_id, key.block_hashes), r.num_queued,
                                        r.replica_id))
    n = state.index.num_matched(best.replica_id, key.block_hashes)
    return RouteDecision(best.replica_id, RouteReason.PREFIX if n else RouteReason.LEAST_LOADED, n)


def prefix_load_replica(key: RouteKey, replicas: Sequence[ReplicaLoad], state: RouterState,
                        config: PolicyConfig) -> RouteDecision | None:
    """The lowest cost = blocks the replica would prefill + `queue_cost_blocks` x its requests in flight,
    among replicas not overloaded (as `choose_replica` picks for a request without a home)."""
    if not replicas:
        return None
    ranked = sorted(replicas, key=lambda r: (load_score(r, config), r.replica_id))
    return _choose_fresh(key, ranked, state, config)


def decide(mode: str, key: RouteKey, replicas: Sequence[ReplicaLoad], state: RouterState,
           config: PolicyConfig) -> RouteDecision | None:
    """The decision of router `mode`: "session_kv" (ours, `choose_replica`) or a baseline."""
    if mode == "sticky":
        return sticky_replica(key, replicas)
    if mode == "prefix":
        return longest_prefix_replica(key, replicas, state)
    if mode == "prefix-load":
        return prefix_load_replica(key, replicas, state, config)
    if mode == "session_kv":
        return choose_replica(key, replicas, state, config)
    raise ValueError(f"unknown router {mode!r}; choose from session_kv, {', '.join(BASELINES)}")


def apply(state: RouterState, key: RouteKey, replica_id: str) -> None:
    """Record that `key` was sent to `replica_id`: its blocks will be cached there, its session lives there."""
    state.index.record(replica_id, key.block_hashes)
    if key.session_key is not None:
        old = state.affinity.get(key.session_key)
        if old != replica_id:
            if old is not None:
                state.num_sessions[old] = state.num_sessions.get(old, 1) - 1
            state.num_sessions[replica_id] = state.num_sessions.get(replica_id, 0) + 1
            state.affinity[key.session_key] = replica_id


def forget_session(state: RouterState, session_key: str) -> None:
    old = state.affinity.pop(session_key, None)
    if old is not None:
        state.num_sessions[old] = state.num_sessions.get(old, 1) - 1


def forget_replica(state: RouterState, replica_id: str) -> None:
    """A replica left: drop what it cached; its sessions keep it as owner until re-routed (failover)."""
    state.index.forget(replica_id)


def ranked_fallbacks(decision: RouteDecision, replicas: Sequence[ReplicaLoad],
                     config: PolicyConfig) -> list[str]:
    """The other replicas, least loaded first: where to go if the chosen one refuses."""
    rest = [r for r in replicas if r.replica_id != decision.replica_id]
    return [r.replica_id for r in sorted(rest, key=lambda r: (load_score(r, config), r.replica_id))]
