"""Admission by working set on the tiny model: new sessions wait at the door, admitted ones keep running."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from sessionserve import LLMEngine, SamplingParams
from sessionserve.config import Config

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def engine(path: Path, admission: str) -> LLMEngine:
    return LLMEngine(Config.from_kwargs(num_blocks=64, block_size=16, max_num_seqs=8, residency_policy="keep",
                                        host_kv_bytes=0, disk_kv_bytes=0, admission=admission,
                                        admission_fill=1.0, admission_hold_s=0.2), path)


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(50, 16000, (length,), generator=g).tolist() for _ in range(n)]


def run_rounds(eng: LLMEngine, num_sessions: int, rounds: int) -> tuple[dict[int, list[list[int]]], int]:
    """Every session sends a turn, all finish; `rounds` times. Returns outputs and the most requests that ran
    at once. (Sessions admitted first stay in the working set for `admission_hold_s` after their turn: the
    rest wait at the door until then.)"""
    sids = [eng.open_session() for _ in range(num_sessions)]
    outs: dict[int, list[list[int]]] = {i: [] for i in range(num_sessions)}
    firsts, nexts = prompts(1, num_sessions, 300), prompts(2, num_sessions * rounds, 20)
    most_running = 0
    for r in range(rounds):
        rids = {eng.add_request(firsts[i] if r == 0 else nexts[r * num_sessions + i], GREEDY, session_id=sid): i
                for i, sid in enumerate(sids)}
        deadline = time.monotonic() + 60
        while rids and time.monotonic() < deadline:
            step = eng.step()
            for out in step:
                if out.finished and out.request_id in rids:
                    i = rids.pop(out.request_id)
                    outs[i].append(out.token_ids)
                    eng.park(sids[i], tools=("tool",), expected_wait_s=0.01)
            most_running = max(most_running, len(eng.core.scheduler.running))
            eng.kv.check_integrity()
            if not step:
                time.sleep(0.01)  # the held ones wait for admitted sessions to go idle
        assert not rids, "turns did not finish"
    for sid in sids:
        eng.close_session(sid)
    return outs, most_running


def test_new_sessions_wait_at_the_door_and_outputs_are_unchanged(tiny_llama: Path) -> None:
    # 6 sessions of ~20 blocks against 64 device blocks: three fit at a time.
    free_for_all, _ = run_rounds(engine(tiny_llama, "off"), 6, 2)
    eng = engine(tiny_llama, "working-set")
    held, most_running = run_rounds(eng, 6, 2)
    assert held == free_for_all  # greedy: admission changes when a turn runs, never what it computes
    door = eng.core.door
    assert door is not None and door.num_held_total >= 3  # the ones past the budget waited
    assert most_running <= 4  # never more sessions in flight than their contexts fit (+1 partial)
    assert not door.held and eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_a_returning_turn_of_an_admitted_session_does_not_wait(tiny_llama: Path) -> None:
    eng = engine(tiny_llama, "working-set")
    sid = eng.open_session()
    first = eng.add_request(prompts(3, 1, 100)[0], GREEDY, session_id=sid)
    while eng.has_unfinished():
        eng.step()
    assert eng.core.door.num_held_total == 1  # a new session's first turn goes through the door
    eng.park(sid, tools=("tool",), expected_wait_s=1.0)  # active for max(0.2 s, 3 x its expected wait)
    eng.add_request([5, 6, 7], GREEDY, session_id=sid)
    assert eng.core.door.num_held_total == 1 and not eng.core.door.held
    assert first


def engine_reserving(path: Path, admission: str, typical_blocks: int) -> LLMEngine:
    """An engine whose door, if any, acts as if sessions that left had grown to `typical_blocks`: each admitted
    session reserves that many."""
    eng = engine(path, admission)
    if eng.core.door is not None:
        eng.core.door.typical_blocks = typical_blocks
    return eng


def run(eng: LLMEngine, sid: str, token_ids: list[int]) -> tuple[list[int], bool]:
    """One turn of `sid`, to its end; then the session parks. Returns its tokens and whether it waited at the
    door."""
    rid = eng.add_request(token_ids, GREEDY, session_id=sid)
    held = eng.core.door is not None and eng.core.door.is_holding(sid)
    out: list[int] = []
    deadline = time.monotonic() + 30
    while eng.has_unfinished():
        assert time.monotonic() < deadline, "the turn never ran"
        out += [t for o in eng.step() if o.request_id == rid and o.finished for t in o.token_ids]
        eng.kv.check_integrity()
    eng.park(sid, tools=("tool",), expected_wait_s=10.0)  # back within 30 s: keeps a place if it has one
    return out, held


def test_an_idle_engine_lends_a_turn_to_a_waiting_session_without_giving_it_a_place(tiny_llama: Path) -> None:
    firsts, nexts = prompts(7, 2, 300), prompts(8, 2, 20)  # ~20 blocks each, 64 in the device KV
    outputs: dict[str, list[list[int]]] = {}
    for admission in ("off", "working-set"):
        eng = engine_reserving(tiny_llama, admission, 40)
        door = eng.core.door
        a, b = eng.open_session(), eng.open_session()
        outputs[admission] = [run(eng, a, firsts[0])[0]]
        out, held = run(eng, b, firsts[1])  # 40 + 40 > 64: b waits for a place, but nothing runs
        outputs[admission].append(out)
        if door is not None:
            assert held and door.num_lent == 1 and list(door.admitted) == [a]  # it ran on loan, placeless
            # The residency policy sees who has a place: b's KV is the first to leave when memory is short.
            assert set(eng.core.sessions.view(0.0, 0).members or ()) == {a}
        else:
            assert eng.core.sessions.view(0.0, 0).members is None  # no door: every session alike
        out, held = run(eng, b, nexts[1])
        outputs[admission].append(out)
        if door is not None:
            assert held and door.num_lent == 2 and list(door.admitted) == [a]  # at the door again, lent again
            assert eng.core.sessions.get(b).stats.num_recompute_tokens == 0  # its KV stayed: nothing recomputed
        outputs[admission].append(run(eng, a, nexts[0])[0])  # a's place held: in at once
        for sid in (a, b):
            eng.close_session(sid)
        assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
        eng.close()
    assert outputs["working-set"] == outputs["off"]  # when a turn runs changes, never what it computes


def test_a_loan_takes_the_kv_of_sessions_without_a_place_never_an_admitted_ones(tiny_llama: Path) -> None:
    firsts, longer = prompts(7, 3, 300), prompts(8, 1, 100)  # ~20 blocks each, 64 in the device KV
    outputs: dict[str, list[list[int]]] = {}
    for admission in ("off", "working-set"):
        eng = engine_reserving(tiny_llama, admission, 40)
        door = eng.core.door
        a, b, c = eng.open_session(), eng.open_session(), eng.open_session()
        outputs[admission] = [run(eng, sid, firsts[i])[0] for i, sid in enumerate((a, b, c))]
        # b and c ran on loan and parked their KV: 4 blocks are left free, and b's next turn needs 26 (its 20
        # and 6 more). It goes in on loan all the same: c's KV, without a place, is what makes room.
        out, held = run(eng, b, longer[0])
        outputs[admission].append(out)
        sessions = eng.core.sessions
        if door is not None:
            assert held and door.num_lent == 3 and list(door.admitted) == [a]
            assert sessions.get(c).residency.value == "none"  # c's KV made room
            assert sessions.get(a).residency.value == "device"  # the admitted session's stayed
        outputs[admission].append(run(eng, c, longer[0][:10])[0])  # c recomputes; what it computes is the same
        for sid in (a, b, c):
            eng.close_session(sid)
        assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
        eng.close()
    assert outputs["working-set"] == outputs["off"]


def measured(eng: LLMEngine, wait_s: float, prefill_s_per_token: float) -> None:
    """Set what "auto" admission weighs: the agents' tool waits and the cost of a recomputed token."""
    for _ in range(1100):  # more than the predictor's window of all waits: these set its median
        eng.core.sessions.predictor.observe(("other",), wait_s)
    eng.core.prefill_s_per_token = prefill_s_per_token


def test_auto_admission_holds_only_where_a_recompute_costs_more_than_a_tool_wait(tiny_llama: Path) -> None:
    free_for_all, _ = run_rounds(engine(tiny_llama, "off"), 6, 2)
    # Recomputing a ~300-token context is cheaper than the agents' waits: every turn goes in, as with "off".
    eng = engine(tiny_llama, "auto")
    assert eng.core.door is not None and not eng.core.door.enforcing  # nothing measured yet: it does not hold
    assert eng.core.sessions.members is None  # nor does the residency policy favour anyone
    measured(eng, wait_s=1000.0, prefill_s_per_token=1e-3)
    outs, _ = run_rounds(eng, 6, 2)
    assert outs == free_for_all and eng.core.door.num_held_total == 0 and not eng.core.door.enforcing
    # Where it costs more than a wait, the door holds new sessions past the working set, as "working-set" does.
    eng = engine(tiny_llama, "auto")
    measured(eng, wait_s=1e-6, prefill_s_per_token=1e-3)
    outs, most_running = run_rounds(eng, 6, 2)
    door = eng.core.door
    assert outs == free_for_all and door.enforcing and door.num_held_total >= 3 and most_running <= 4
    assert eng.core.sessions.members == door.admitted.keys()
    assert not door.held and eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_sessions_that_went_in_while_the_door_was_open_stay_admitted_once_it_holds(tiny_llama: Path) -> None:
    eng = engine(tiny_llama, "auto")
    measured(eng, wait_s=1000.0, prefill_s_per_token=1e-3)
    sids = [eng.open_session() for _ in range(4)]
    for sid, p in zip(sids[:3], prompts(4, 3, 300)):  # ~20 blocks each: three fill the 64-block budget
        eng.add_request(p, GREEDY, session_id=sid)
    while eng.has_unfinished():
        eng.step()
    for sid in sids[:3]:
        eng.park(sid, tools=("tool",), expected_wait_s=30.0)  # each comes back within 3 x its wait
    door = eng.core.door
    assert door.num_held_total == 0 and set(door.admitted) == set(sids[:3])
    measured(eng, wait_s=1e-6, prefill_s_per_token=1e-3)  # now thrashing costs more than waiting
    for sid in sids[:3]:  # the admitted sessions' next turns pass the door
        eng.add_request([7, 8, 9], GREEDY, session_id=sid)
    assert door.enforcing and door.num_held_total == 0
    eng.add_request(prompts(5, 1, 300)[0], GREEDY, session_id=sids[3])  # a new one waits for room
    assert door.num_held_total == 1 and len(door.held) == 1
    for sid in sids:
        eng.close_session(sid)
    assert not door.held
    for _ in range(100):
        if not eng.has_unfinished():
            break
        eng.step()
    assert not eng.has_unfinished()
    eng.kv.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    eng.close()


def burst_then_held(eng: LLMEngine, close_door: bool) -> list[list[int]]:
    """Five sessions of ~20 blocks go in at once while the door is open (the 64-block budget fits three), then
    each sends a second turn; with `close_door`, thrashing has come to cost more than waiting by then.
    Returns every turn's output, in order."""
    sids = [eng.open_session() for _ in range(5)]
    outs: dict[str, list[list[int]]] = {sid: [] for sid in sids}
    session_of: dict[str, str] = {}

    def finish_all(wait_s: float) -> None:
        deadline = time.monotonic() + 60
        while eng.has_unfinished() and time.monotonic() < deadline:
            for out in eng.step():
                if out.finished:
                    sid = session_of[out.request_id]
                    outs[sid].append(out.token_ids)
                    eng.park(sid, tools=("tool",), expected_wait_s=wait_s)
            eng.kv.check_integrity()
            time.sleep(0.002)
        assert not eng.has_unfinished(), "turns did not finish"

    for sid, p in zip(sids, prompts(6, 5, 300)):
        session_of[eng.add_request(p, GREEDY, session_id=sid)] = sid
    finish_all(wait_s=0.01)
    if close_door:
        measured(eng, wait_s=1e-6, prefill_s_per_token=1e-3)
    for sid in sids:
        session_of[eng.add_request([7, 8, 9], GREEDY, session_id=sid)] = sid
    door = eng.core.door
    if close_door:
        # The three that went in first keep their places; the two past the budget wait at the door.
        assert door.enforcing and door.num_demoted == 2 and list(door.admitted) == sids[:3]
        assert [h.session_id for h in door.held] == sids[3:]
    finish_all(wait_s=0.01)  # the held ones go in once the first three have gone idle past their waits
    for sid in sids:
        eng.close_session(sid)
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    return [o for sid in sids for o in outs[sid]]


def test_sessions_past_the_budget_lose_their_place_when_the_door_starts_to_hold(tiny_llama: Path) -> None:
    free_for_all = burst_then_held(engine(tiny_llama, "off"), close_door=False)
    eng = engine(tiny_llama, "auto")
    measured(eng, wait_s=1000.0, prefill_s_per_token=1e-3)  # open: all five go in
    assert burst_then_held(eng, close_door=True) == free_for_all  # when a turn runs changes, never what it computes


def test_reject_mode_refuses_new_sessions_past_the_working_set_with_a_retry_time(tiny_llama: Path) -> None:
    from sessionserve.core.admission import AdmissionFull

    eng = LLMEngine(Config.from_kwargs(num_blocks=64, block_size=16, max_num_seqs=8, residency_policy="keep",
                                       host_kv_bytes=0, disk_kv_bytes=0, admission="working-set",
                                       admission_fill=1.0, admission_hold_s=0.2, admission_when_full="reject"),
                    tiny_llama)
    sids = [eng.open_session() for _ in range(6)]
    firsts = prompts(1, 6, 300)  # ~20 blocks each: three fit in 64
    admitted, refused = [], []
    for sid, p in zip(sids, firsts):
        try:
            admitted.append(eng.add_request(p, GREEDY, session_id=sid))
        except AdmissionFull as exc:
            assert 1.0 <= exc.retry_after_s <= 180.0  # until an admitted session stops counting
            refused.append(sid)
        for _ in range(3):
            eng.step()  # held turns are let in at the next step
    assert 1 <= len(admitted) <= 3 and refused
    assert not eng.core.door.held and eng.core.door.num_rejected == len(refused)
    while eng.has_unfinished():
        eng.step()
    # a refused session is untouched: its turn is accepted later, once the admitted ones have left
    for sid in sids:
        if sid not in refused:
            eng.close_session(sid)
    rid = eng.add_request(firsts[sids.index(refused[0])], GREEDY, session_id=refused[0])
    while eng.has_unfinished():
        eng.step()
    assert eng.get_session(refused[0]) is not None and rid
    for sid in refused:
        eng.close_session(sid)
    eng.kv.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    eng.close()
