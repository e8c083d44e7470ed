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
