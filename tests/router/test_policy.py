"""Routing policy: affinity, failover, longest cached prefix, least loaded, rebalance on overload."""

from __future__ import annotations

from sessionserve.cache.block_hash import extend_block_hashes
from sessionserve.router.policy import (
    PolicyConfig,
    ReplicaLoad,
    RouteKey,
    RouteReason,
    RouterState,
    apply,
    choose_replica,
    forget_replica,
    ranked_fallbacks,
)

CFG = PolicyConfig()


def hashes(tokens: list[int], block_size: int = 4) -> tuple[bytes, ...]:
    return tuple(extend_block_hashes([], tokens, block_size))


def loads(*queued: int, free: tuple[int, ...] | None = None, parked: tuple[int, ...] | None = None,
          ) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"r{i}", num_queued=q, max_queued=10, num_free_blocks=None if free is None else free[i],
                        num_total_blocks=None if free is None else 100,
                        num_parked_sessions=0 if parked is None else parked[i])
            for i, q in enumerate(queued)]


def test_no_replicas_is_none() -> None:
    assert choose_replica(RouteKey(), [], RouterState.create(CFG), CFG) is None


def test_new_sessions_spread_then_stick() -> None:
    state = RouterState.create(CFG)
    replicas = loads(0, 0)
    first = {}
    for i, s in enumerate("abcd"):
        key = RouteKey(session_key=s, block_hashes=hashes(list(range(i * 1000, i * 1000 + 256))))  # 64 blocks
        d = choose_replica(key, replicas, state, CFG)
        assert d.reason is RouteReason.LEAST_LOADED
        apply(state, key, d.replica_id)
        first[s] = (d.replica_id, key)
    assert sorted(r for r, _ in first.values()) == ["r0", "r0", "r1", "r1"]  # equal replicas share new sessions
    for _ in range(3):  # later steps go home even when home is busier: moving would recompute 64 blocks
        for home, key in first.values():
            d = choose_replica(key, loads(5, 0) if home == "r0" else loads(0, 5), state, CFG)
            assert (d.replica_id, d.reason) == (home, RouteReason.AFFINITY)

def test_store_owner_wins_over_router_memory() -> None:
    state = RouterState.create(CFG)
    apply(state, RouteKey(session_key="s"), "r0")
    d = choose_replica(RouteKey(session_key="s", owner="r1"), loads(0, 0), state, CFG)
    assert (d.replica_id, d.reason) == ("r1", RouteReason.AFFINITY)


def test_failover_when_owner_is_gone() -> None:
    state = RouterState.create(CFG)
    d = choose_replica(RouteKey(session_key="s", owner="dead"), loads(3, 1), state, CFG)
    assert (d.replica_id, d.reason, d.previous_owner) == ("r1", RouteReason.FAILOVER, "dead")


def test_longest_prefix_wins() -> None:
    state = RouterState.create(CFG)
    system = list(range(100, 132))  # 8 blocks
    apply(state, RouteKey(block_hashes=hashes(system[:8])), "r0")  # 2 blocks cached on r0
    apply(state, RouteKey(block_hashes=hashes(system + [1, 2, 3, 4])), "r1")  # 9 blocks on r1
    key = RouteKey(block_hashes=hashes(system + [9, 9, 9, 9, 9]))
    d = choose_replica(key, loads(1, 2), state, CFG)
    assert (d.replica_id, d.reason, d.num_matched_blocks) == ("r1", RouteReason.PREFIX, 8)


def test_prefix_is_weighed_against_queue_and_yields_to_overload() -> None:
    state = RouterState.create(CFG)
    key = RouteKey(block_hashes=hashes(list(range(64))))  # 16 blocks
    apply(state, key, "r0")
    # cost = blocks to prefill + 4 x requests in flight: r0 3 x 4 = 12 < r1 16 + 0
    assert choose_replica(key, loads(3, 0), state, CFG).reason is RouteReason.PREFIX
    d = choose_replica(key, loads(5, 0), state, CFG)  # r0 20 > r1 16: the queue outweighs the cache
    assert (d.replica_id, d.reason) == ("r1", RouteReason.LEAST_LOADED)
    d = choose_replica(key, loads(0, 0, free=(1, 50)), state, CFG)  # r0's KV is full
    assert (d.replica_id, d.reason) == ("r1", RouteReason.LEAST_LOADED)

def test_tenant_salt_separates_prefixes() -> None:
    state = RouterState.create(CFG)
    tokens = list(range(16))
    apply(state, RouteKey(block_hashes=tuple(extend_block_hashes([], tokens, 4, salt=b"alice"))), "r0")
    d = choose_replica(RouteKey(block_hashes=tuple(extend_block_hashes([], tokens, 4, salt=b"bob"))),
                       loads(1, 1), state, CFG)
    assert d.reason is RouteReason.LEAST_LOADED and d.num_matched_blocks == 0


def test_least_loaded_counts_queue_kv_and_parked() -> None:
    state = RouterState.create(CFG)
    assert choose_replica(RouteKey(), loads(2, 1), state, CFG).replica_id == "r1"
    assert choose_replica(RouteKey(), loads(1, 1, free=(90, 20)), state, CFG).replica_id == "r0"
    assert choose_replica(RouteKey(), loads(1, 1, free=(50, 50), parked=(10, 0)), state, CFG).replica_id == "r1"


def test_rebalance_when_queue_gap_outweighs_recompute_or_home_overloaded() -> None:
    state = RouterState.create(CFG)
    key = RouteKey(session_key="s", block_hashes=hashes(list(range(64))))  # 16 blocks of history on r0
    apply(state, key, "r0")
    assert choose_replica(key, loads(1, 0), state, CFG).reason is RouteReason.AFFINITY  # gap under the minimum
    assert choose_replica(key, loads(3, 0), state, CFG).reason is RouteReason.AFFINITY  # 3 x 4 < 16 blocks
    d = choose_replica(key, loads(5, 0), state, CFG)  # 5 x 4 > 16: cheaper to recompute on r1
    assert (d.replica_id, d.reason, d.previous_owner) == ("r1", RouteReason.REBALANCE, "r0")
    long_key = RouteKey(session_key="s", block_hashes=hashes(list(range(400))))  # 100 blocks
    assert choose_replica(long_key, loads(7, 0), state, CFG).reason is RouteReason.AFFINITY
    d = choose_replica(long_key, loads(9, 0), state, CFG)  # overloaded home: leave whatever it costs
    assert (d.replica_id, d.reason) == ("r1", RouteReason.REBALANCE)
    d = choose_replica(long_key, loads(9, 8), state, CFG)  # nowhere clearly better to go
    assert d.reason is RouteReason.AFFINITY

def test_forget_replica_drops_its_prefixes() -> None:
    state = RouterState.create(CFG)
    key = RouteKey(block_hashes=hashes(list(range(16))))
    apply(state, key, "r0")
    forget_replica(state, "r0")
    assert choose_replica(key, loads(1, 0), state, CFG).reason is RouteReason.LEAST_LOADED


def test_prefix_index_is_bounded_lru() -> None:
    cfg = PolicyConfig(max_index_blocks=4)
    state = RouterState.create(cfg)
    old = hashes(list(range(16)))
    apply(state, RouteKey(block_hashes=old), "r0")
    apply(state, RouteKey(block_hashes=hashes(list(range(50, 66)))), "r0")
    assert state.index.num_blocks("r0") == 4
    assert state.index.num_matched("r0", old) == 0


def test_fallbacks_exclude_choice() -> None:
    state = RouterState.create(CFG)
    replicas = loads(3, 0, 1)
    d = choose_replica(RouteKey(), replicas, state, CFG)
    assert d.replica_id == "r1" and ranked_fallbacks(d, replicas, CFG) == ["r2", "r0"]


def test_released_session_routes_as_new() -> None:
    state = RouterState.create(CFG)
    apply(state, RouteKey(session_key="s"), "gone")
    d = choose_replica(RouteKey(session_key="s", is_released=True), loads(2, 0), state, CFG)
    assert (d.replica_id, d.reason) == ("r1", RouteReason.LEAST_LOADED)


# -- baselines -----------------------------------------------------------------------------------


def test_sticky_hashes_sessions_consistently_and_ignores_load() -> None:
    from sessionserve.router.policy import sticky_replica

    three, two = loads(0, 0, 0), loads(0, 0)
    homes = {f"s{i}": sticky_replica(RouteKey(session_key=f"s{i}"), three).replica_id for i in range(200)}
    assert set(homes.values()) == {"r0", "r1", "r2"}  # spread over every replica
    busy = loads(9, 0, 0)  # load does not move a session
    assert all(sticky_replica(RouteKey(session_key=s), busy).replica_id == r for s, r in homes.items())
    # r2 leaves: only its sessions move
    moved = {s for s, r in homes.items() if sticky_replica(RouteKey(session_key=s), two).replica_id != r}
    assert moved == {s for s, r in homes.items() if r == "r2"}
    assert sticky_replica(RouteKey(), loads(3, 1, 2)).replica_id == "r1"  # no session: fewest in flight


def test_prefix_router_takes_the_longest_match_then_the_least_loaded() -> None:
    from sessionserve.router.policy import RouteReason, decide, longest_prefix_replica

    state = RouterState.create(CFG)
    short, long = RouteKey(block_hashes=hashes(list(range(8)))), RouteKey(block_hashes=hashes(list(range(16))))
    apply(state, short, "r0")
    apply(state, long, "r1")
    follow = RouteKey(session_key="x", block_hashes=hashes(list(range(20))))
    d = longest_prefix_replica(follow, loads(0, 9), state)
    assert (d.replica_id, d.reason, d.num_matched_blocks) == ("r1", RouteReason.PREFIX, 4)  # load not weighed
    fresh = RouteKey(block_hashes=hashes([99] * 8))
    assert longest_prefix_replica(fresh, loads(5, 2), state).replica_id == "r1"
    assert decide("prefix", fresh, loads(5, 2), state, CFG) == longest_prefix_replica(fresh, loads(5, 2), state)
    assert decide("session_kv", fresh, loads(0, 0), state, CFG) == choose_replica(fresh, loads(0, 0), state, CFG)


def test_prefix_load_router_weighs_the_prefix_against_the_queue() -> None:
    from sessionserve.router.policy import decide

    state = RouterState.create(CFG)
    long = RouteKey(block_hashes=hashes(list(range(16))))  # 4 blocks of 4
    apply(state, long, "r1")
    follow = RouteKey(session_key="x", block_hashes=hashes(list(range(20))))  # 5 blocks, 4 cached on r1
    assert decide("prefix-load", follow, loads(0, 0), state, CFG).replica_id == "r1"
    # r1 busier by 2 requests (4 blocks each, CFG) costs more than the 4 blocks r0 would prefill
    assert decide("prefix-load", follow, loads(0, 2), state, CFG).replica_id == "r0"
    assert decide("prefix", follow, loads(0, 2), state, CFG).replica_id == "r1"
