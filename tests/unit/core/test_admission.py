"""Session admission by working set: the pure policy, with hand-built views."""

from __future__ import annotations

from sessionserve.core.admission import AdmissionView, Candidate, Member, WorkingSetAdmission, door_pays

POLICY = WorkingSetAdmission(budget_blocks=100, min_hold_s=30.0, hold_factor=3.0)


def view(members: list[Member], candidates: list[Candidate], num_running: int = 0) -> AdmissionView:
    return AdmissionView(tuple(members), tuple(candidates), num_running)


def test_admits_in_order_while_the_working_set_fits() -> None:
    members = [Member("a", 40, None, None), Member("b", 30, 2.0, 1.0)]  # running; parked, expected back
    cands = [Candidate("r1", "c", 20), Candidate("r2", "d", 20), Candidate("r3", "e", 5)]
    # 70 held; c fits (90), d does not (110): it waits, and e behind it does not overtake it.
    assert POLICY.admit(view(members, cands, num_running=1)) == ("r1",)


def test_sessions_idle_past_their_expected_wait_stop_counting() -> None:
    gone = Member("old", 90, 31.0, None)  # idle past min_hold_s, no hint
    slow_tool = Member("slow", 90, 31.0, 20.0)  # expected back within 3 x 20 s: still counts
    cand = [Candidate("r1", "new", 50)]
    assert POLICY.admit(view([gone], cand)) == ("r1",)
    assert POLICY.admit(view([slow_tool], cand)) == ()
    assert POLICY.working_set_blocks((gone, slow_tool)) == 90


def test_a_session_larger_than_the_budget_still_runs_when_nothing_else_does() -> None:
    cands = [Candidate("r1", "huge", 500), Candidate("r2", "small", 1)]
    assert POLICY.admit(view([], cands)) == ("r1",)
    # Not while something else is in flight: it waits for the working set to drain.
    assert POLICY.admit(view([Member("a", 10, None, None)], cands, num_running=1)) == ()
    assert POLICY.admit(view([], cands, num_running=1)) == ()


def test_an_idle_engine_lends_its_time_to_the_first_waiting_turn_that_fits_the_free_blocks() -> None:
    parked = Member("a", 30, 1.0, 1.0)  # parked, back soon: keeps its place, reserved at the typical 60 blocks
    cands = (Candidate("r1", "b", 40), Candidate("r2", "c", 10))
    idle = AdmissionView((parked,), cands, 0, typical_blocks=60, loanable_blocks=45)
    assert POLICY.admit(idle) == ()  # 60 + 60 > 100: b waits for the working set
    assert POLICY.lend(idle) == "r1"  # but nothing runs and its 40 blocks are free now
    # b's 40 blocks do not fit: c's 10 go in on loan before it (b keeps its place for admission)
    assert POLICY.lend(idle._replace(loanable_blocks=39)) == "r2"
    assert POLICY.lend(idle._replace(loanable_blocks=9)) is None  # neither fits
    assert POLICY.lend(idle._replace(num_running=1)) is None  # something runs: no loan
    assert POLICY.lend(idle._replace(loanable_blocks=0)) is None  # the engine has work (or no block is free)
    assert POLICY.lend(idle._replace(candidates=())) is None


def test_nothing_waiting_admits_nothing() -> None:
    assert POLICY.admit(view([Member("a", 10, None, None)], [])) == ()


def test_the_door_pays_where_recomputing_a_context_costs_more_than_a_tool_wait() -> None:
    # llama-small on 2 cores: ~0.4 ms a token, 3,000-token contexts (1.2 s), waits of 0.8 s: hold
    assert door_pays(4e-4, 3000, 0.8)
    # a tiny model: 20 us a token, 1,800 tokens (36 ms) against the same waits: let everyone in
    assert not door_pays(2e-5, 1800, 0.8)
    # slow tools make thrashing the cheaper of the two
    assert not door_pays(4e-4, 3000, 5.0)
    # until both costs are measured the door does not hold
    assert not door_pays(None, 1800, 0.8)
    assert not door_pays(2e-5, 1800, None)
