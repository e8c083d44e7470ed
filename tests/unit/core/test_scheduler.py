"""The continuous-batching scheduler, driven by a fake executor."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from sessionserve.types.sequence import SequenceStatus
from tests.unit.core.utils import create_scheduler, create_seq, run_step


def test_prefill_then_decode_until_max_tokens() -> None:
    sched = create_scheduler()
    seq = create_seq(10, max_tokens=3)
    sched.add(seq)
    plan, _ = run_step(sched)
    assert [(c.start, c.num_tokens) for c in plan.chunks] == [(0, 10)]
    plan, _ = run_step(sched)
    assert [(c.start, c.num_tokens) for c in plan.chunks] == [(10, 1)]
    _, finished = run_step(sched)
    assert finished == [seq] and seq.status is SequenceStatus.FINISHED_LENGTH
    assert seq.output_token_ids == [7, 7, 7]
    assert sched.kv.num_free_blocks == 64
    sched.kv.check_integrity()


def test_long_prompt_is_chunked_and_decodes_go_first() -> None:
    sched = create_scheduler(max_num_batched_tokens=16)
    a = create_seq(5, max_tokens=10)
    sched.add(a)
    run_step(sched)  # a prefilled
    b = create_seq(40, max_tokens=2)
    sched.add(b)
    plan, _ = run_step(sched)
    assert [(c.seq, c.start, c.num_tokens) for c in plan.chunks] == [(a, 5, 1), (b, 0, 15)]
    assert not plan.chunks[1].samples
    plan, _ = run_step(sched)
    assert [(c.seq, c.start, c.num_tokens) for c in plan.chunks] == [(a, 6, 1), (b, 15, 15)]
    plan, _ = run_step(sched)
    assert [(c.seq, c.start, c.num_tokens) for c in plan.chunks] == [(a, 7, 1), (b, 30, 10)]
    assert plan.chunks[1].samples and plan.num_batched_tokens == 11


def test_no_chunking_waits_for_a_budget_that_fits() -> None:
    sched = create_scheduler(max_num_batched_tokens=16, chunked=False)
    sched.add(create_seq(10))
    sched.add(create_seq(10))
    plan, _ = run_step(sched)
    assert len(plan.chunks) == 1


def test_max_num_seqs_bounds_the_batch() -> None:
    sched = create_scheduler(max_num_seqs=2)
    for _ in range(4):
        sched.add(create_seq(3))
    plan, _ = run_step(sched)
    assert len(plan.chunks) == 2 and len(sched.waiting) == 2


def test_prefix_cache_hit_skips_cached_tokens() -> None:
    sched = create_scheduler(block_size=4)
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks
    first = create_seq(0, max_tokens=1, tokens=prompt)
    sched.add(first)
    run_step(sched)
    second = create_seq(0, max_tokens=1, tokens=prompt[:12] + [999])
    sched.add(second)
    plan, _ = run_step(sched)
    assert [(c.start, c.num_tokens) for c in plan.chunks] == [(12, 1)]
    assert second.num_cached_tokens == 12


def test_a_prefix_being_prefilled_is_not_computed_twice() -> None:
    """Siblings sent together with the same long prefix: the later ones wait for it to be cached; a request
    with another prefix is not held up by them."""
    sched = create_scheduler(block_size=4, max_num_batched_tokens=16)
    shared = list(range(100, 140))  # 40 tokens: 10 blocks, 3 steps at 16 tokens a step
    first, second = (create_seq(0, max_tokens=1, tokens=shared + [500 + i, 600 + i]) for i in range(2))
    other = create_seq(0, max_tokens=1, tokens=list(range(300, 306)))
    for seq in (first, second, other):
        sched.add(seq)
    computed: dict[str, int] = {}
    for _ in range(10):
        plan, _ = run_step(sched)
        for c in plan.chunks:
            computed[c.seq.request_id] = computed.get(c.seq.request_id, 0) + c.num_tokens
        if not sched.num_unfinished:
            break
    assert not sched.num_unfinished and sched.num_prefix_waits > 0
    assert second.num_cached_tokens == 40 and computed[second.request_id] == 2
    assert computed[first.request_id] == 42 and other.num_cached_tokens == 0
    sched.kv.check_integrity()
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks


def test_preemption_by_recompute_never_loses_a_sequence() -> None:
    # 6 blocks of 4 tokens: two sequences of 8 prompt tokens + 8 outputs cannot both fit.
    sched = create_scheduler(num_blocks=6, block_size=4, prefix=False)
    a, b = create_seq(8, max_tokens=8), create_seq(8, max_tokens=8)
    sched.add(a)
    sched.add(b)
    finished = []
    preempted = []
    for _ in range(60):
        plan, done = run_step(sched)
        finished += done
        preempted += plan.preempted
        sched.kv.check_integrity()
        if not sched.num_unfinished:
            break
    assert preempted, "the pool is too small for both: someone must have been preempted"
    assert set(finished) == {a, b}
    assert a.output_token_ids == [7] * 8 and b.output_token_ids == [7] * 8
    assert sched.kv.num_free_blocks == 6


def test_finish_while_waiting_or_running_frees_everything() -> None:
    sched = create_scheduler()
    a, b = create_seq(6), create_seq(6)
    sched.add(a)
    run_step(sched)
    sched.add(b)
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    sched.finish(b, SequenceStatus.FINISHED_ABORTED)  # idempotent
    assert sched.num_unfinished == 0 and sched.kv.num_free_blocks == 64
    sched.kv.check_integrity()


def test_same_inputs_same_plans() -> None:
    def plans() -> list[tuple]:
        sched = create_scheduler(num_blocks=12, max_num_batched_tokens=20, max_num_seqs=3)
        for n in (9, 17, 4, 30, 2):
            sched.add(create_seq(n, max_tokens=5, tokens=list(range(n)), rid=f"s{n}"))
        out = []
        while sched.num_unfinished:
            plan, _ = run_step(sched)
            out.append(tuple((c.seq.request_id, c.start, c.num_tokens) for c in plan.chunks) + plan.preempted)
        return out

    assert plans() == plans()


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_random_workloads_finish_and_leak_nothing(seed: int) -> None:
    rng = random.Random(seed)
    sched = create_scheduler(num_blocks=rng.randint(8, 24), block_size=4, max_num_seqs=rng.randint(1, 6),
                             max_num_batched_tokens=rng.randint(4, 40), prefix=rng.random() < 0.7)
    seqs = []
    for _ in range(rng.randint(1, 8)):
        n = rng.randint(1, 20)
        tokens = [rng.randint(0, 3) for _ in range(n)]  # small alphabet: many shared prefixes
        seqs.append(create_seq(0, max_tokens=rng.randint(1, 8), tokens=tokens))
    for s in seqs:
        sched.add(s)
    for _ in range(2000):
        if not sched.num_unfinished:
            break
        if rng.random() < 0.05:
            victim = rng.choice(seqs)
            sched.finish(victim, SequenceStatus.FINISHED_ABORTED)
        run_step(sched)
        sched.kv.check_integrity()
        for s in sched.running:
            assert len(sched.kv.block_tables[s.request_id]) * 4 >= s.num_computed_tokens
    assert sched.num_unfinished == 0
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    for s in seqs:
        assert s.is_finished
        if s.status is not SequenceStatus.FINISHED_ABORTED:
            assert len(s.output_token_ids) == s.sampling_params.max_tokens


def test_a_sequence_that_would_outgrow_the_whole_cache_stops_at_its_size() -> None:
    sched = create_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    seq = create_seq(6, max_tokens=100)
    sched.add(seq)
    for _ in range(30):
        if not sched.num_unfinished:
            break
        run_step(sched)
    assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.num_tokens == 16
    assert sched.num_preemptions == 0 and sched.kv.num_free_blocks == 4


def test_prefill_tokens_bound_the_prompt_work_batched_with_decodes() -> None:
    """While a sequence decodes, prompt chunks (a new one's and a running one's) share `prefill_tokens`;
    decodes are never held back by it, and with nothing decoding prompts take the whole budget."""
    sched = create_scheduler(num_blocks=128, max_num_batched_tokens=64)
    streaming = create_seq(4, max_tokens=50)
    sched.add(streaming)
    run_step(sched, now_s=0.0)  # its prompt: it decodes from now on
    long_prompt, other = create_seq(100), create_seq(30)
    sched.add(long_prompt)
    sched.add(other)
    plan = sched.schedule(1.0, prefill_tokens=12)
    sizes = {c.seq.request_id: c.num_tokens for c in plan.chunks}
    assert sizes == {streaming.request_id: 1, long_prompt.request_id: 12}, sizes
    sched.update(plan, {streaming.request_id: 7})
    plan = sched.schedule(2.0, prefill_tokens=12)  # the running prompt's next chunk, still within the bound
    sizes = {c.seq.request_id: c.num_tokens for c in plan.chunks}
    assert sizes == {streaming.request_id: 1, long_prompt.request_id: 12}, sizes
    sched.update(plan, {streaming.request_id: 7})
    sched.finish(streaming, SequenceStatus.FINISHED_ABORTED)  # nothing decodes: the bound is off
    plan = sched.schedule(3.0, prefill_tokens=12)
    assert [(c.seq, c.num_tokens) for c in plan.chunks] == [(long_prompt, 64)]  # the whole step's budget
