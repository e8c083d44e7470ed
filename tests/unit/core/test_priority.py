"""Session-aware scheduling: priority classes, least attained service, aging, preemption for SLOs."""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sessionserve.config import SchedulerConfig
from sessionserve.core.priority import PriorityPolicy, priority_rank
from sessionserve.types.sequence import Program, SequenceStatus
from tests.unit.core.utils import create_scheduler, create_seq, run_step

INTERACTIVE, BATCH = 0, 1


def test_policy_key_orders_class_then_service_level_then_arrival() -> None:
    pol = PriorityPolicy(las_quantum_tokens=100, aging_s=10, starvation_s=60)
    keys = {
        "batch_new": pol.key(BATCH, 0, arrival_s=0.0, now_s=1.0),
        "inter_heavy": pol.key(INTERACTIVE, 1000, arrival_s=0.5, now_s=1.0),
        "inter_light_late": pol.key(INTERACTIVE, 50, arrival_s=0.9, now_s=1.0),
        "inter_light_early": pol.key(INTERACTIVE, 10, arrival_s=0.1, now_s=1.0),
    }
    assert sorted(keys, key=keys.get) == ["inter_light_early", "inter_light_late", "inter_heavy", "batch_new"]
    assert [pol.service_level(n) for n in (0, 99, 100, 299, 300, 700)] == [0, 0, 1, 1, 2, 3]


def test_aging_promotes_batch_and_starvation_resets_service() -> None:
    pol = PriorityPolicy(las_quantum_tokens=100, aging_s=10, starvation_s=60)
    assert pol.key(BATCH, 0, 0.0, now_s=9.9)[0] == 1
    assert pol.key(BATCH, 0, 0.0, now_s=10.0)[0] == 0
    assert pol.key(INTERACTIVE, 10_000, 0.0, now_s=59.0)[2] > 0
    assert pol.key(INTERACTIVE, 10_000, 0.0, now_s=60.0)[2] == 0
    assert pol.key(BATCH, 0, 0.0, now_s=None)[0] == 1  # no clock: no aging


def test_aged_batch_lines_up_behind_interactive_until_it_starves() -> None:
    pol = PriorityPolicy(aging_s=10, starvation_s=60)
    old_batch = pol.key(BATCH, 0, arrival_s=0.0, now_s=20.0, program_start_s=0.0)  # aged into class 0
    new_interactive = pol.key(INTERACTIVE, 0, arrival_s=19.0, now_s=20.0, program_start_s=19.0)
    fresh_batch = pol.key(BATCH, 0, arrival_s=19.0, now_s=20.0, program_start_s=1.0)
    assert new_interactive < old_batch < fresh_batch
    starving = pol.key(BATCH, 0, arrival_s=0.0, now_s=61.0, program_start_s=0.0)
    assert starving < pol.key(INTERACTIVE, 0, arrival_s=60.0, now_s=61.0, program_start_s=19.0)


def test_a_long_running_batch_turn_does_not_age_past_interactive_work() -> None:
    """Aging is for waiting: a batch turn admitted at once and still running 20 s later keeps its class, so
    when memory runs out the interactive turn admitted after it is not the one preempted (even with the
    batch turn past `starvation_s` since it arrived)."""
    sched = create_scheduler(num_blocks=8, max_num_batched_tokens=64, aging_s=1.0, starvation_s=2.0,
                             preempt_after_s=100.0, prefix=False)
    batch = create_seq(8, max_tokens=40, priority=BATCH, arrival_s=0.0, program=Program(start_s=0.0))
    sched.add(batch)
    run_step(sched, now_s=0.0)
    inter = create_seq(8, max_tokens=40, priority=INTERACTIVE, arrival_s=10.0, program=Program(start_s=10.0))
    sched.add(inter)
    now, victims = 10.0, []
    while not victims and not inter.is_finished:
        plan, _ = run_step(sched, now_s=now)
        victims = list(plan.preempted)
        now += 0.5
    assert victims == [batch.request_id]
    sched.kv.check_integrity()


def test_service_levels_off_by_default() -> None:
    pol = PriorityPolicy()
    assert pol.key(INTERACTIVE, 10**9, 1.0, 1.0) < pol.key(INTERACTIVE, 0, 2.0, 2.0)  # arrival within a class
    with pytest.raises(ValueError):
        PriorityPolicy(las_quantum_tokens=-1)


def test_fcfs_is_arrival_order_only() -> None:
    pol = PriorityPolicy(policy="fcfs")
    assert pol.key(BATCH, 10**6, 1.0, 5.0) < pol.key(INTERACTIVE, 0, 2.0, 5.0)
    assert not pol.is_urgent(INTERACTIVE, 0.0, 100.0)


def test_program_order_puts_an_older_programs_next_step_first() -> None:
    """Within a class, requests line up by when their program (session) started, not when they came in."""
    pol = PriorityPolicy()
    old_next_step = pol.key(INTERACTIVE, 0, arrival_s=5.0, now_s=6.0, program_start_s=0.0)
    young_first_step = pol.key(INTERACTIVE, 0, arrival_s=4.0, now_s=6.0, program_start_s=4.0)
    assert old_next_step < young_first_step
    by_request = PriorityPolicy(order="request")
    assert by_request.key(INTERACTIVE, 0, 5.0, 6.0, program_start_s=0.0) > \
        by_request.key(INTERACTIVE, 0, 4.0, 6.0, program_start_s=4.0)
    # Classes still come first, and a lone request (no program start) is its own program.
    assert pol.key(BATCH, 0, 5.0, 6.0, program_start_s=0.0) > young_first_step
    assert pol.key(INTERACTIVE, 0, 3.0, 6.0) < young_first_step


@pytest.mark.parametrize("policy,old_first", [("priority", True), ("fcfs", False)])
def test_admission_follows_program_start(policy: str, old_first: bool) -> None:
    sched = create_scheduler(max_num_batched_tokens=12, scheduling_policy=policy)
    young = create_seq(12, arrival_s=1.0, program=Program(start_s=1.0))
    old = create_seq(12, arrival_s=2.0, program=Program(start_s=0.0))
    sched.add(young)
    sched.add(old)
    plan, _ = run_step(sched, now_s=2.0)
    assert [c.seq for c in plan.chunks] == [old if old_first else young]


def test_bad_policy_values_raise() -> None:
    with pytest.raises(ValueError):
        PriorityPolicy(policy="lifo")
    with pytest.raises(ValueError, match="scheduling order"):
        PriorityPolicy(order="newest")
    with pytest.raises(ValueError):
        PriorityPolicy(aging_s=0)
    with pytest.raises(ValueError):
        priority_rank("urgent")


def test_policy_from_config_and_bad_config_values_raise() -> None:
    config = SchedulerConfig(scheduling_policy="fcfs", scheduling_order="request", las_quantum_tokens=64, aging_s=2.0,
                             starvation_s=9.0, preempt_after_s=0.25, max_num_batched_tokens=320)
    assert PriorityPolicy.from_config(config) == PriorityPolicy(
        policy="fcfs", las_quantum_tokens=64, aging_s=2.0, starvation_s=9.0, preempt_after_s=0.25, order="request",
        background_prefill_tokens=20)  # 1/16 of the step budget when not set
    for bad in ({"scheduling_policy": "lifo"}, {"scheduling_order": "newest"}, {"aging_s": 0},
                {"background_prefill_tokens": -1}):
        with pytest.raises(ValueError):
            SchedulerConfig(**bad)


@pytest.mark.parametrize("policy,interactive_first", [("priority", True), ("fcfs", False)])
def test_admission_order_interactive_first_or_arrival(policy: str, interactive_first: bool) -> None:
    sched = create_scheduler(max_num_batched_tokens=16, scheduling_policy=policy, background_prefill_tokens=0)
    batch = create_seq(12, priority=BATCH, arrival_s=0.0)
    inter = create_seq(12, priority=INTERACTIVE, arrival_s=1.0)
    sched.add(batch)
    sched.add(inter)
    plan, _ = run_step(sched, now_s=1.0)
    first, second = (inter, batch) if interactive_first else (batch, inter)
    assert [(c.seq, c.num_tokens) for c in plan.chunks] == [(first, 12), (second, 4)]


def test_running_batch_prefill_yields_budget_to_waiting_interactive() -> None:
    sched = create_scheduler(max_num_batched_tokens=16, background_prefill_tokens=0)
    batch = create_seq(60, priority=BATCH)
    sched.add(batch)
    run_step(sched, now_s=0.0)  # batch mid-prefill: 16 of 60
    inter = create_seq(10, priority=INTERACTIVE, arrival_s=0.1)
    sched.add(inter)
    plan, _ = run_step(sched, now_s=0.1)
    assert [(c.seq, c.start, c.num_tokens) for c in plan.chunks] == [(inter, 0, 10), (batch, 16, 6)]


def test_background_prefill_is_limited_while_interactive_turns_run() -> None:
    sched = create_scheduler(max_num_batched_tokens=32, background_prefill_tokens=4)
    inter = create_seq(8, max_tokens=3, priority=INTERACTIVE)
    batch = create_seq(60, max_tokens=2, priority=BATCH)
    waiting_batch = create_seq(20, priority=BATCH, arrival_s=0.5)
    sched.add(inter)
    sched.add(batch)
    plan, _ = run_step(sched, now_s=0.0)
    assert [(c.seq, c.num_tokens) for c in plan.chunks] == [(inter, 8), (batch, 4)]
    sched.add(waiting_batch)
    plan, _ = run_step(sched, now_s=1.0)  # the interactive turn decodes: steps stay short
    assert [(c.seq, c.num_tokens) for c in plan.chunks] == [(inter, 1), (batch, 4)]
    plan, _ = run_step(sched, now_s=1.1)  # its last token
    assert [(c.seq, c.num_tokens) for c in plan.chunks] == [(inter, 1), (batch, 4)]
    assert inter.is_finished
    plan, _ = run_step(sched, now_s=1.2)  # background alone: the whole budget again
    assert [(c.seq, c.num_tokens) for c in plan.chunks] == [(batch, 32)]


def test_background_prefill_limit_is_a_share_of_the_step_by_default() -> None:
    assert create_scheduler(max_num_batched_tokens=512).policy.background_prefill_tokens == 32
    assert create_scheduler(max_num_batched_tokens=8).policy.background_prefill_tokens == 1
    assert create_scheduler(max_num_batched_tokens=512, background_prefill_tokens=0).policy \
        .background_prefill_tokens == 0
    with pytest.raises(ValueError, match="background_prefill_tokens"):
        create_scheduler(background_prefill_tokens=-1)


def test_light_program_goes_before_heavy_one_of_same_class() -> None:
    sched = create_scheduler(max_num_batched_tokens=8, las_quantum_tokens=16)
    heavy, light = Program(service_tokens=500), Program(service_tokens=3)
    first = create_seq(8, arrival_s=0.0, program=heavy)
    second = create_seq(8, arrival_s=1.0, program=light)
    sched.add(first)
    sched.add(second)
    plan, _ = run_step(sched, now_s=1.0)
    assert [c.seq for c in plan.chunks] == [second]
    assert light.service_tokens == 3 + 8  # service is charged to the program
    assert second.service_at_arrival == 3  # ... but a running request keeps its place


def test_running_request_is_not_demoted_by_its_own_progress() -> None:
    sched = create_scheduler(max_num_batched_tokens=8, las_quantum_tokens=4)
    long_one = create_seq(40, arrival_s=0.0, program=Program())
    sched.add(long_one)
    run_step(sched, now_s=0.0)  # 8 tokens of service: level 1 by now
    short = create_seq(4, arrival_s=0.5, program=Program(service_tokens=6))  # level 1 at arrival, arrived later
    sched.add(short)
    plan, _ = run_step(sched, now_s=0.5)
    assert [c.seq for c in plan.chunks] == [long_one]  # the long prefill keeps the budget; no interleaving


def test_urgent_interactive_preempts_batch_only_after_threshold() -> None:
    # 8 blocks of 4 tokens: two batch sequences hold all of them.
    sched = create_scheduler(num_blocks=8, max_num_batched_tokens=64, preempt_after_s=0.5, prefix=False)
    b1, b2 = create_seq(15, max_tokens=50, priority=BATCH), create_seq(15, max_tokens=50, priority=BATCH)
    sched.add(b1)
    sched.add(b2)
    run_step(sched, now_s=0.0)
    inter = create_seq(12, priority=INTERACTIVE, arrival_s=0.1)
    sched.add(inter)
    plan, _ = run_step(sched, now_s=0.3)  # waited 0.2 s: not yet urgent
    assert inter not in [c.seq for c in plan.chunks] and not plan.preempted
    plan, _ = run_step(sched, now_s=0.7)  # waited 0.6 s: preempt the last batch sequence
    assert plan.preempted == (b2.request_id,)
    assert [c.seq for c in plan.chunks] == [b1, inter]
    assert b2.status is SequenceStatus.WAITING and b2.num_computed_tokens == 0
    assert sched.num_priority_preemptions == 1
    sched.kv.check_integrity()


def test_urgent_interactive_never_preempts_interactive() -> None:
    sched = create_scheduler(num_blocks=8, max_num_batched_tokens=64, preempt_after_s=0.0, prefix=False)
    a, b = create_seq(15, max_tokens=50), create_seq(15, max_tokens=50)
    sched.add(a)
    sched.add(b)
    run_step(sched, now_s=0.0)
    late = create_seq(12, arrival_s=0.1)
    sched.add(late)
    plan, _ = run_step(sched, now_s=5.0)
    assert not plan.preempted and late not in [c.seq for c in plan.chunks]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), policy=st.sampled_from(["priority", "fcfs"]), las=st.sampled_from([0, 16]),
       bg=st.sampled_from([None, 0, 4]))
@example(seed=157, policy="priority", las=16, bg=0)  # once a livelock: an aged batch victim readmitted, preempted again
@example(seed=397, policy="priority", las=16, bg=0)  # once a deadlock: deferred batch chunks holding all the memory
def test_no_sequence_starves_and_no_block_leaks(seed: int, policy: str, las: int, bg: int | None) -> None:
    """Random mixed arrivals under memory pressure: everything finishes, within a bound, blocks all return."""
    rng = random.Random(seed)
    sched = create_scheduler(num_blocks=24, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                             scheduling_policy=policy, aging_s=2.0, starvation_s=6.0, preempt_after_s=0.5,
                             las_quantum_tokens=las, background_prefill_tokens=bg, prefix=False)
    programs = [Program(start_s=None if i == 0 else rng.uniform(0.0, 3.0)) for i in range(5)]
    seqs, now, step = [], 0.0, 0
    while step < 3000 and (len(seqs) < 60 or sched.num_unfinished):
        if len(seqs) < 60 and rng.random() < 0.3:
            seq = create_seq(rng.randint(1, 30), max_tokens=rng.randint(1, 20), priority=rng.randint(0, 1),
                             arrival_s=now, program=rng.choice(programs))
            sched.add(seq)
            seqs.append(seq)
        run_step(sched, now_s=now)
        now += 0.1
        step += 1
    assert all(s.is_finished for s in seqs), "a sequence starved"
    assert sched.kv.num_free_blocks == 24
    sched.kv.check_integrity()


def test_a_prompt_that_cannot_fit_whole_waits_and_smaller_turns_go_ahead_until_it_starves() -> None:
    """Admitting a prompt whose chunks will not all fit only preempts others (or itself) chunk by chunk: it
    waits, with its whole need shown to the residency policy, while turns behind it that fit go ahead;
    once it has waited `starvation_s`, nothing passes it."""
    sched = create_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=8, starvation_s=5.0,
                             preempt_after_s=100.0, prefix=False)
    holder = create_seq(20, max_tokens=30, arrival_s=0.0)  # 5 blocks, growing
    sched.add(holder)
    for t in range(3):
        run_step(sched, now_s=0.1 * t)
    big = create_seq(28, arrival_s=1.0)  # 7 blocks: not with the holder's 5
    small = create_seq(4, arrival_s=1.1)
    sched.add(big)
    sched.add(small)
    plan, _ = run_step(sched, now_s=1.2)
    assert small in [c.seq for c in plan.chunks] and big not in [c.seq for c in plan.chunks]
    assert sched.num_wanted_blocks >= 7 and big.request_id not in sched.kv.block_tables
    late = create_seq(4, arrival_s=6.5)
    sched.add(late)
    plan, _ = run_step(sched, now_s=6.5)  # the big prompt has waited 5.5 s: the queue stops at it
    assert late not in [c.seq for c in plan.chunks]
    while not big.is_finished:
        run_step(sched, now_s=7.0)
    sched.kv.check_integrity()


@pytest.mark.parametrize("big_tokens, reclaimed", [(28, False), (32, True)])
def test_waiting_turns_keep_their_kv_unless_taking_it_makes_room(big_tokens: int, reclaimed: bool) -> None:
    """A turn that resumes with KV it holds (restored from the host tier, say) loses it to a prompt ahead of
    it only when that makes room for the prompt: dropping it and admitting nothing anyway would make it
    recompute for nothing."""
    sched = create_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=8, starvation_s=100.0,
                             preempt_after_s=100.0, prefix=False)
    holder = None
    if not reclaimed:
        holder = create_seq(12, max_tokens=30, arrival_s=0.0)  # 4 blocks after 3 steps
        sched.add(holder)
        for t in range(3):
            run_step(sched, now_s=0.1 * t)
    big = create_seq(big_tokens, arrival_s=1.0)  # 7 blocks (with the holder's 4: 3 free + 3 held < 7) or 8
    resumed = create_seq(13, arrival_s=2.0)
    assert sched.kv.allocate(resumed.request_id, 12) is not None  # 3 blocks of KV it brought back
    resumed.num_computed_tokens = 12
    sched.add(big)
    sched.add(resumed)
    plan, _ = run_step(sched, now_s=2.1)
    scheduled = {c.seq.request_id: c for c in plan.chunks}
    if reclaimed:
        assert big.request_id in scheduled and resumed.num_preemptions == 1
        assert resumed.request_id not in sched.kv.block_tables
    else:
        assert big.request_id not in scheduled and resumed.num_preemptions == 0
        assert scheduled[resumed.request_id].start == 12  # resumed on its own KV: one token to compute
    while not (big.is_finished and resumed.is_finished and (holder is None or holder.is_finished)):
        run_step(sched, now_s=200.0)
    assert sched.kv.num_free_blocks == 10
    sched.kv.check_integrity()


def test_fcfs_admits_chunk_by_chunk_as_a_request_level_server_does() -> None:
    sched = create_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=8, scheduling_policy="fcfs",
                             prefix=False)
    holder = create_seq(20, max_tokens=30, arrival_s=0.0)
    sched.add(holder)
    for t in range(3):
        run_step(sched, now_s=0.1 * t)
    big = create_seq(28, arrival_s=1.0)
    sched.add(big)
    plan, _ = run_step(sched, now_s=1.2)
    assert big in [c.seq for c in plan.chunks]
