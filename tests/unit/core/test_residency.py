"""Residency policies as pure functions of a view: no engine, no clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessionserve.core.residency import (
    POLICIES,
    ActionKind,
    MoveCosts,
    ParkedSession,
    ResidencyView,
    ViewDelta,
    make_policy,
)
from sessionserve.core.session import Residency
from sessionserve.core.wait_predictor import WaitPrediction
from sessionserve.types.kv_mover import Tier

COSTS = MoveCosts(host_s_per_block=0.001, disk_s_per_block=0.01, recompute_s_per_token=0.001)


def parked(sid: str, *, blocks: int = 10, parked_s: float = 0.0, p50: float = 5.0,
           residency: Residency = Residency.DEVICE, shared: int = 0) -> ParkedSession:
    return ParkedSession(sid, residency, blocks, blocks * 16, parked_s, WaitPrediction(p50 / 4, p50, p50 * 4, 10),
                         shared)


def view(sessions, *, now: float = 1.0, free: int = 50, total: int = 100, wanted: int = 0,
         host: int = 1000, disk: int = 1000) -> ResidencyView:
    return ResidencyView(now, tuple(sessions), total, free, wanted, host, disk, COSTS)


def kinds(actions) -> dict[str, ActionKind]:
    return {a.session_id: a.kind for a in actions}


def test_unknown_policy_name() -> None:
    with pytest.raises(ValueError, match="unknown residency policy"):
        make_policy("lru")


def test_discard_drops_every_parked_session_on_device() -> None:
    acts = make_policy("discard").decide(view([parked("a"), parked("b", residency=Residency.HOST)]))
    assert kinds(acts) == {"a": ActionKind.DROP}


def test_keep_does_nothing_without_pressure_and_drops_oldest_under_it() -> None:
    keep = make_policy("keep")
    sessions = [parked("old", parked_s=0.0), parked("new", parked_s=0.5)]
    assert keep.decide(view(sessions)) == ()
    acts = keep.decide(view(sessions, free=0, wanted=5))
    assert kinds(acts) == {"old": ActionKind.DROP}


def test_ttl_drops_after_its_time_to_live() -> None:
    ttl = make_policy("ttl")
    s = parked("a", parked_s=0.0, p50=2.0)  # ttl = 1.5 * 2 = 3 s
    assert ttl.decide(view([s], now=2.9)) == ()
    assert kinds(ttl.decide(view([s], now=3.1))) == {"a": ActionKind.DROP}


def test_least_waste_keeps_short_waits_and_swaps_long_ones() -> None:
    lw = make_policy("least-waste")
    short = parked("short", p50=0.01, parked_s=1.0)
    long = parked("long", p50=100.0)
    acts = lw.decide(view([short, long]))
    assert kinds(acts) == {"long": ActionKind.OFFLOAD}
    assert acts[0].tier is Tier.HOST
    # No host room: a long wait is dropped instead (recompute wastes less than holding 100 s).
    assert kinds(lw.decide(view([long], host=0))) == {"long": ActionKind.DROP}


def test_predictive_keeps_short_waits_and_moves_long_ones_at_once() -> None:
    pol = make_policy("predictive")
    assert pol.decide(view([parked("short", p50=0.1, parked_s=0.99)], free=40)) == ()
    acts = pol.decide(view([parked("long", p50=100.0)], free=40))
    assert kinds(acts) == {"long": ActionKind.OFFLOAD} and acts[0].tier is Tier.HOST
    # Without host room a long wait stays put until memory is actually short.
    assert pol.decide(view([parked("long", p50=100.0)], free=40, host=0)) == ()


def test_predictive_holds_long_waits_while_the_device_is_mostly_free() -> None:
    """At most half the device used, holding a long wait costs nobody anything: it stays (no move out and
    back, no late restore); past half, it leaves at once; off-device sessions are still prefetched."""
    pol = make_policy("predictive")
    long_wait = parked("long", p50=100.0)
    assert pol.decide(view([long_wait], free=50)) == ()
    assert pol.next_decision_s(view([long_wait], free=50)) is None  # only memory use can make it leave
    assert kinds(pol.decide(view([long_wait], free=49))) == {"long": ActionKind.OFFLOAD}
    due = parked("due", p50=1.0, residency=Residency.HOST, parked_s=0.0)
    assert kinds(pol.decide(view([long_wait, due], free=90, now=0.98))) == {"due": ActionKind.PREFETCH}


def test_predictive_demotes_farthest_next_use_first() -> None:
    pol = make_policy("predictive")
    soon, late = parked("soon", p50=0.1, parked_s=0.99), parked("late", p50=60.0)
    acts = pol.decide(view([soon, late], free=5))  # 5 below the 10% watermark
    assert kinds(acts) == {"late": ActionKind.OFFLOAD}
    assert acts[0].tier is Tier.HOST


def test_predictive_uses_disk_when_host_is_full_and_drops_when_both_are() -> None:
    pol = make_policy("predictive")
    s = parked("a", p50=60.0)
    acts = pol.decide(view([s], free=0, wanted=5, host=0))
    assert acts[0].kind is ActionKind.OFFLOAD and acts[0].tier is Tier.DISK
    assert kinds(pol.decide(view([s], free=0, wanted=5, host=0, disk=0))) == {"a": ActionKind.DROP}


def test_predictive_sends_a_soon_resuming_session_to_disk_when_a_restore_beats_recomputing_it() -> None:
    # Host full, a wait shorter than the disk round trip (2 x 10 blocks x 10 ms): a restore from disk still
    # costs less than prefilling its 160 tokens again (0.16 s), so it goes to disk, not away.
    s = parked("a", parked_s=1.0, p50=0.05)
    acts = make_policy("predictive").decide(view([s], free=0, wanted=5, host=0))
    assert kinds(acts) == {"a": ActionKind.OFFLOAD} and acts[0].tier is Tier.DISK
    # A disk slower than 4x recomputing: dropped.
    slow = ResidencyView(1.0, (s,), 100, 0, 5, 0, 1000, MoveCosts(0.001, 0.05, 0.001))
    assert kinds(make_policy("predictive").decide(slow)) == {"a": ActionKind.DROP}


def test_predictive_prefetches_just_before_the_predicted_resume() -> None:
    pol = make_policy("predictive")
    s = parked("a", parked_s=0.0, p50=10.0, residency=Residency.HOST)
    assert pol.decide(view([s], now=5.0, free=80)) == ()
    assert kinds(pol.decide(view([s], now=9.99, free=80))) == {"a": ActionKind.PREFETCH}
    # No room above the watermark: no prefetch.
    assert pol.decide(view([s], now=9.99, free=12)) == ()


def test_predictive_never_acts_on_sessions_in_flight() -> None:
    pol = make_policy("predictive")
    moving = [parked("o", residency=Residency.OFFLOADING, p50=100.0), parked("r", residency=Residency.RESTORING)]
    assert pol.decide(view(moving, free=0, wanted=50)) == ()


@pytest.mark.parametrize("name", ["discard", "keep", "ttl", "least-waste", "predictive"])
def test_policies_free_enough_under_pressure(name: str) -> None:
    sessions = [parked(f"s{i}", blocks=10, parked_s=i * 0.1, p50=1.0 + i) for i in range(8)]
    acts = make_policy(name).decide(view(sessions, free=0, wanted=25))
    freed = sum(10 for a in acts if a.kind in (ActionKind.DROP, ActionKind.OFFLOAD))
    assert freed >= 25
    assert len({a.session_id for a in acts}) == len(acts)  # one action per session


@pytest.mark.parametrize("name", ["keep", "ttl", "least-waste", "predictive"])
def test_under_pressure_sessions_whose_blocks_others_read_go_last(name: str) -> None:
    """A parked parent whose blocks its running forks read frees nothing by leaving: the policies count
    the blocks a move frees, and take the sessions that free something first."""
    readers = [parked(f"parent{i}", blocks=10, shared=10, parked_s=0.0, p50=50.0) for i in range(3)]
    own = [parked(f"own{i}", blocks=10, shared=4, parked_s=0.5 + i * 0.1, p50=10.0 + i) for i in range(4)]
    acts = make_policy(name).decide(view(readers + own, free=0, wanted=12))
    moved = {a.session_id for a in acts if a.kind in (ActionKind.DROP, ActionKind.OFFLOAD)}
    assert sum(6 for sid in moved if sid.startswith("own")) >= 12  # 6 own blocks each
    assert not any(sid.startswith("parent") for sid in moved), acts


# Per policy, waits that make it take the admitted sessions first when it does not know the door's working set.
@pytest.mark.parametrize("name,p50_in,p50_out", [("keep", 100.0, 1.0), ("ttl", 1.0, 100.0),
                                                 ("least-waste", 1.0, 1.0), ("predictive", 100.0, 1.0)])
def test_under_pressure_sessions_outside_the_admission_doors_working_set_go_first(name: str, p50_in: float,
                                                                                   p50_out: float) -> None:
    """A session whose next turn waits at the door (or ran on loan) comes back later than its wait says: the
    admitted sessions keep their KV while the others have some to give."""
    members = [parked(f"in{i}", parked_s=0.1 * i, p50=p50_in) for i in range(3)]  # parked first
    others = [parked(f"out{i}", parked_s=0.9, p50=p50_out) for i in range(2)]
    v = view(members + others, free=10, wanted=25, host=0, disk=0)  # 15 blocks to free: both others
    acts = make_policy(name).decide(v._replace(members=frozenset(m.session_id for m in members)))
    assert {a.session_id for a in acts} == {"out0", "out1"}, acts
    assert {a.session_id for a in make_policy(name).decide(v)} & {"in0", "in1", "in2"}  # without the door: not so


def test_predictive_does_not_move_a_session_others_read_without_pressure() -> None:
    pol = make_policy("predictive")
    acts = pol.decide(view([parked("read", p50=100.0, shared=10), parked("alone", p50=100.0)], free=40))
    assert kinds(acts) == {"alone": ActionKind.OFFLOAD}


def test_policies_are_deterministic() -> None:
    sessions = [parked(f"s{i}", blocks=3 + i, parked_s=i * 0.3, p50=2.0 * i + 1) for i in range(6)]
    for name in ("discard", "keep", "ttl", "least-waste", "predictive"):
        v = view(sessions, free=5, wanted=20, now=4.0)
        assert make_policy(name).decide(v) == make_policy(name).decide(v)


# -- next_decision_s: the clock alone never changes an answer before it --------------------------

_RESIDENCIES = (Residency.DEVICE, Residency.HOST, Residency.DISK, Residency.OFFLOADING, Residency.RESTORING)


@st.composite
def _views(draw):
    n = draw(st.integers(1, 8))
    sessions = []
    for i in range(n):
        p50 = draw(st.floats(0.01, 50.0))
        p90 = p50 * draw(st.floats(1.0, 6.0))
        blocks = draw(st.integers(1, 40))
        sessions.append(ParkedSession(f"s{i}", draw(st.sampled_from(_RESIDENCIES)), blocks,
                                      draw(st.integers(1, 600)), draw(st.floats(0.0, 30.0)),
                                      WaitPrediction(p50 / 4, p50, p90, 10),
                                      draw(st.sampled_from([0, 0, blocks // 2, blocks]))))
    now = max(s.parked_s for s in sessions) + draw(st.floats(0.0, 60.0))
    total = draw(st.integers(50, 400))
    free = draw(st.integers(0, total))
    # No admission door, or one whose working set holds some of the parked sessions.
    members = draw(st.sampled_from([None, None, frozenset(), frozenset(s.session_id for s in sessions[::2])]))
    return ResidencyView(now, tuple(sessions), total, free, draw(st.sampled_from([0, 0, 5, 80])),
                         draw(st.integers(0, 200)), draw(st.integers(0, 200)), COSTS, members=members)


@pytest.mark.parametrize("name,indexed", [(n, False) for n in sorted(POLICIES)] + [("predictive", True)])
@settings(max_examples=150, deadline=None, derandomize=True)
@given(v=_views(), fractions=st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=1, max_size=6))
def test_decision_holds_until_next_decision_time(name: str, indexed: bool, v: ResidencyView,
                                                 fractions: list[float]) -> None:
    """After a `decide` with no action, the engine skips `decide` while only the clock moves and it
    is before `next_decision_s`: at any such moment the answer must still be no action."""
    policy = make_policy(name, indexed)
    if policy.decide(v):
        return
    due = policy.next_decision_s(v)
    assert due is None or due >= v.now_s
    horizon = (due - v.now_s) if due is not None else 1e4
    for f in fractions:
        later = v._replace(now_s=v.now_s + f * horizon)
        if due is not None and later.now_s >= due:  # rounded up onto the due time itself
            continue
        assert policy.decide(later) == (), (name, later.now_s, due)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(v=_views(), steps=st.lists(st.tuples(st.floats(0.0, 20.0), st.integers(0, 7),
                                            st.sampled_from(["same", "replace", "move", "leave", "park", "free"])),
                                  min_size=1, max_size=10))
def test_predictive_remembers_nothing_that_changes_an_answer(v: ResidencyView, steps) -> None:
    """Indexed, the predictive policy keeps its per-session states from view to view; over a run of views
    (time moving, sessions changing, moving between tiers, leaving and parking, room changing, the last
    view asked again, as the engine asks lazily, and an older one) it answers as the plain policy does."""
    kept = make_policy("predictive", indexed=True)
    views = [v]
    for n, (dt, k, change) in enumerate(steps):
        last = views[-1]
        parked_now = list(last.parked)
        free = last.num_free_device_blocks
        k = k % len(parked_now) if parked_now else 0
        if change == "replace" and parked_now:  # the session changed: a new entry (e.g. it parked again)
            s = parked_now[k]
            parked_now[k] = s._replace(parked_s=last.now_s + dt / 2, num_blocks=s.num_blocks + 1)
        elif change == "move" and parked_now:  # a move began or ended: same session, another residency
            s = parked_now[k]
            parked_now[k] = s._replace(residency=_RESIDENCIES[(_RESIDENCIES.index(s.residency) + 1) % 5])
        elif change == "leave" and parked_now:  # its turn began
            del parked_now[k]
        elif change == "park":
            parked_now.append(ParkedSession(f"new{n}", Residency.DEVICE, 4 + k, 60, last.now_s + dt / 2,
                                            WaitPrediction(0.5, 2.0 + k, 9.0 + k, 10)))
        elif change == "free":
            free = (free + 37 * (k + 1)) % (last.num_device_blocks + 1)
        parked_now = tuple(parked_now)
        delta = None
        if n % 3:  # and tell the policy what changed, as the session manager does (else it compares)
            before = {id(s) for s in last.parked}
            delta = ViewDelta(last.parked, tuple(s for s in parked_now if id(s) not in before),
                              tuple({s.session_id for s in last.parked} - {s.session_id for s in parked_now}))
        views.append(last._replace(now_s=last.now_s + dt, parked=parked_now, num_free_device_blocks=free,
                                   delta=delta))
    for i, w in enumerate(views):
        for asked in (w, views[max(0, i - 1)]):  # and an older view after a newer one
            fresh = make_policy("predictive")
            assert kept.decide(asked) == fresh.decide(asked)
            assert kept.next_decision_s(asked) == fresh.next_decision_s(asked)


@pytest.mark.parametrize("indexed", [False, True])
@settings(max_examples=200, deadline=None, derandomize=True)
@given(parked_s=st.floats(0.0, 100.0), p50=st.floats(0.5, 50.0), waited=st.floats(0.0, 1.0, exclude_max=True))
def test_predictive_prefetches_at_the_time_it_gave(indexed: bool, parked_s: float, p50: float,
                                                   waited: float) -> None:
    """Woken at its own next decision time, the policy sees the change: a prefetch due then starts then,
    whatever the rounding of the time (the engine of a simulator wakes at exactly that float)."""
    s = ParkedSession("s", Residency.HOST, 10, 160, parked_s, WaitPrediction(p50 / 4, p50, p50 * 4, 10))
    policy = make_policy("predictive", indexed)
    v = view([s], now=parked_s + waited * (p50 / 2), free=80, total=100)
    assert policy.decide(v) == ()
    due = policy.next_decision_s(v)
    assert due is not None and due > v.now_s
    assert kinds(policy.decide(v._replace(now_s=due))) == {"s": ActionKind.PREFETCH}


def test_predictive_follows_the_views_delta() -> None:
    """Told what changed since the view before, the policy forgets sessions gone and looks again at
    changed ones: a long wait that left the view is not offloaded, a changed one is judged anew."""
    policy = make_policy("predictive", indexed=True)
    long_wait = parked("long", p50=100.0)
    short = parked("short", p50=0.01, parked_s=1.0)
    v1 = view([long_wait, short], free=40, total=100, now=1.0)._replace(num_free_host_blocks=0)
    assert policy.decide(v1) == ()  # the long wait must leave, but the host has no room yet
    v2 = v1._replace(parked=(short,), num_free_host_blocks=500, delta=ViewDelta(v1.parked, (), ("long",)))
    assert policy.decide(v2) == ()
    assert policy.next_decision_s(v2) == make_policy("predictive").next_decision_s(v2) > 1.0
    longer = short._replace(predicted=WaitPrediction(25.0, 100.0, 400.0, 10))
    v3 = v2._replace(parked=(longer,), delta=ViewDelta(v2.parked, (longer,), ()))
    assert kinds(policy.decide(v3)) == {"short": ActionKind.OFFLOAD}


def test_predictive_counts_offloads_under_way_against_the_need() -> None:
    """Blocks a move out already under way will free count against the pressure: the next tick, before the
    move lands, does not evict a second session for the same need."""
    pol = make_policy("predictive")
    a, b = parked("a", p50=60.0), parked("b", p50=0.2, parked_s=0.99)  # a long wait, a short one
    first = pol.decide(view([a, b], free=10, wanted=18))  # 8 blocks short (10 each)
    assert kinds(first) == {"a": ActionKind.OFFLOAD}
    moving = a._replace(residency=Residency.OFFLOADING)
    assert pol.decide(view([moving, b], free=10, wanted=18)) == ()
    assert kinds(pol.decide(view([moving, b], free=10, wanted=25))) == {"b": ActionKind.OFFLOAD}


@settings(max_examples=300, deadline=None, derandomize=True)
@given(v=_views(), later=st.lists(st.floats(0.0, 80.0), min_size=1, max_size=4))
def test_predictive_indexed_decides_as_the_plain_policy(v: ResidencyView, later: list[float]) -> None:
    """With its index on (incremental per-session states, lazily deleted heaps: the simulator's choice),
    the predictive policy decides what the plain `decide` computes from the view alone, and gives the same
    next decision time, over views whose clock moves on."""
    indexed, plain = make_policy("predictive", indexed=True), make_policy("predictive")
    for w in (v, *(v._replace(now_s=v.now_s + dt) for dt in sorted(later))):
        assert indexed.decide(w) == plain.decide(w)
        assert indexed.next_decision_s(w) == plain.next_decision_s(w)


def test_only_the_predictive_policy_has_an_index() -> None:
    assert make_policy("predictive", indexed=True).indexed and not make_policy("predictive").indexed
    assert make_policy("least-waste", indexed=True) == make_policy("least-waste")
