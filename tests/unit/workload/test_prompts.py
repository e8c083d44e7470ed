"""Prompt construction: deterministic under a seed, shared trace prefixes become shared token ids."""

from __future__ import annotations

from sessionserve.workload.prompts import RESERVED_IDS, PromptBuilder, plan_requests
from sessionserve.workload.trace import AgentSession, Step, ToolCall


def sessions() -> list[AgentSession]:
    shared = Step(50, 4, (ToolCall("tool", 0.01),), "tool", prefix_block_ids=(0, 1), prefix_block_tokens=16)
    return [AgentSession(f"s{i}", (shared, Step(9, 3, (), "end", context_kept_tokens=20 if i else None)))
            for i in range(3)]


def test_shared_blocks_are_identical_across_sessions_private_tokens_are_not() -> None:
    b = PromptBuilder(1000, seed=0)
    x = b.step_tokens("s0", 0, sessions()[0].steps[0])
    y = b.step_tokens("s1", 0, sessions()[1].steps[0])
    assert len(x) == 50 and x[:32] == y[:32] and x[32:] != y[32:]
    assert all(RESERVED_IDS <= t < 1000 - RESERVED_IDS for t in x)
    assert b.step_tokens("s0", 1, sessions()[0].steps[1]) != b.step_tokens("s1", 1, sessions()[1].steps[1])


def test_short_step_takes_a_prefix_of_the_block() -> None:
    b = PromptBuilder(1000, seed=0)
    short = b.step_tokens("s", 0, Step(10, 1, (), "end", (0,), 16))
    assert short == list(b.block(0, 16)[:10])


def test_same_trace_and_seed_give_the_same_request_sequence() -> None:
    a = plan_requests(sessions(), PromptBuilder(1000, seed=7))
    b = plan_requests(sessions(), PromptBuilder(1000, seed=7))
    c = plan_requests(sessions(), PromptBuilder(1000, seed=8))
    assert a == b and a != c
    assert [(r.session_id, r.step_index) for r in a] == [(f"s{i}", k) for i in range(3) for k in range(2)]
    assert a[3].context_kept_tokens == 20 and a[1].context_kept_tokens is None
