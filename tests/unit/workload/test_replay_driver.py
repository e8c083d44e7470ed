"""The replay driver against a fake backend: request sequence fixed by the seed, loops, failures counted."""

from __future__ import annotations

import asyncio

import pytest

from sessionserve.workload.backend import StepResult
from sessionserve.workload.replay import LoadSpec, arrival_times, poisson_arrivals, replay
from sessionserve.workload.trace import AgentSession, Step, ToolCall


class FakeBackend:
    """Records what it is sent; answers instantly. Sessions named 'bad*' fail on their second step."""

    name = "fake"
    vocab_size = 1000

    def __init__(self) -> None:
        self.sent: list[tuple[str, int, tuple[int, ...], int, int | None]] = []
        self.open: set[str] = set()
        self.max_open = 0

    async def start(self) -> None: ...
    async def stop(self) -> None: ...

    async def open_session(self, session_id: str, priority: str = "interactive") -> None:
        self.open.add(session_id)
        self.max_open = max(self.max_open, len(self.open))

    async def generate(self, session_id: str, step_index: int, new_token_ids: list[int], max_tokens: int,
                       context_kept_tokens: int | None = None) -> StepResult:
        if session_id.startswith("bad") and step_index == 1:
            raise RuntimeError("boom")
        self.sent.append((session_id, step_index, tuple(new_token_ids), max_tokens, context_kept_tokens))
        await asyncio.sleep(0)
        return StepResult([7] * max_tokens, 0.001, 0.0005, 0.0001, len(new_token_ids), 0)

    async def park(self, session_id: str, tools: tuple[str, ...], expected_wait_s: float | None) -> None: ...

    async def close_session(self, session_id: str) -> dict[str, float]:
        self.open.discard(session_id)
        return {"num_recompute_tokens": 1}

    def kv_usage(self) -> dict[str, int] | None:
        return None

    def busy_s(self) -> float | None:
        return None


def sessions(n: int = 4) -> list[AgentSession]:
    step = Step(12, 3, (ToolCall("tool", 0.002),), "tool")
    return [AgentSession(f"s{i}", (step, Step(5, 2, (), "end", context_kept_tokens=4))) for i in range(n)]


def test_same_seed_same_request_sequence_and_closed_loop_concurrency() -> None:
    a, b, c = FakeBackend(), FakeBackend(), FakeBackend()
    asyncio.run(replay(a, sessions(), LoadSpec("closed", 2), seed=3))
    asyncio.run(replay(b, sessions(), LoadSpec("closed", 2), seed=3))
    asyncio.run(replay(c, sessions(), LoadSpec("closed", 2), seed=4))
    key = sorted  # timing may interleave sessions differently; the set of requests may not
    assert key(a.sent) == key(b.sent) and key(a.sent) != key(c.sent)
    assert a.max_open == 2 and len(a.sent) == 8
    assert {s[4] for s in a.sent if s[1] == 1} == {4}


def test_open_loop_poisson_and_failures_are_counted() -> None:
    assert poisson_arrivals(5, 2.0, seed=1) == poisson_arrivals(5, 2.0, seed=1)
    assert poisson_arrivals(3, 2.0, seed=1)[0] == 0.0
    fake = FakeBackend()
    trace = sessions(3) + [AgentSession("bad0", sessions(1)[0].steps)]
    result = asyncio.run(replay(fake, trace, LoadSpec("open", rate_per_s=500.0), seed=0))
    bad = next(r for r in result.sessions if r.session_id == "bad0")
    assert bad.error is not None and "boom" in bad.error and bad.jct_s is None
    assert sum(r.jct_s is not None for r in result.sessions) == 3
    assert not fake.open  # failed sessions are closed too


def test_trace_arrivals_need_arrival_times() -> None:
    with pytest.raises(ValueError, match="no arrival"):
        arrival_times(sessions(2), LoadSpec("open"), seed=0)
    timed = [AgentSession(s.session_id, s.steps, arrival_s=5.0 + i) for i, s in enumerate(sessions(2))]
    assert arrival_times(timed, LoadSpec("open"), seed=0) == [0.0, 1.0]


def test_subagents_run_concurrently_and_the_parent_waits_for_the_blocking_ones() -> None:
    from sessionserve.workload.trace import SubAgent

    class Timed(FakeBackend):
        def __init__(self) -> None:
            super().__init__()
            self.t: dict[tuple[str, int], float] = {}

        async def generate(self, session_id, step_index, new_token_ids, max_tokens, context_kept_tokens=None):
            self.t[(session_id, step_index)] = asyncio.get_running_loop().time()
            return await super().generate(session_id, step_index, new_token_ids, max_tokens, context_kept_tokens)

    def child(name: str, wait_s: float) -> AgentSession:
        return AgentSession(name, (Step(4, 1, (ToolCall("tool", wait_s),), "tool", prefix_block_ids=(5,),
                                        prefix_block_tokens=4), Step(2, 1, (), "end")))

    parent = AgentSession("p", (Step(8, 2, (ToolCall("tool", 0.01),), "tool"), Step(3, 1, (), "end")), subagents=(
        SubAgent(0, child("p.sub1", 0.05), 0.05), SubAgent(0, child("p.sub2", 0.10), 0.10),
        SubAgent(0, child("p.bg", 0.30), 0.30, blocking=False)))
    be = Timed()
    result = asyncio.run(replay(be, [parent], LoadSpec("closed", 1)))
    assert [r.session_id for r in result.sessions] == ["p"]
    assert sorted(r.session_id for r in result.subagents) == ["p.bg", "p.sub1", "p.sub2"]
    assert all(r.end_s is not None for r in (*result.sessions, *result.subagents))
    t = be.t
    # All three start together, right after the parent's first step.
    assert max(t[(s, 0)] for s in ("p.sub1", "p.sub2", "p.bg")) - t[("p", 0)] < 0.05
    # The parent's next step waits for the slower blocking one, then its own 0.01 s; not for the background one.
    assert t[("p", 1)] >= t[("p.sub2", 1)] + 0.01
    assert t[("p", 1)] < t[("p.bg", 1)]
    # Siblings' first prompts start with the same template tokens.
    first = {sid: ids for sid, k, ids, *_ in be.sent if k == 0}
    assert first["p.sub1"][:4] == first["p.sub2"][:4] == first["p.bg"][:4]
    assert len(result.steps) == 2 + 3 * 2
