"""ToolExecutor: concurrent steps, dependency order, timeouts, limits, retries under the budget, breakers."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from sessionserve.agent.breaker import BreakerConfig
from sessionserve.agent.executor import PlannedCall, ToolExecutor, ToolResult
from sessionserve.agent.retry import Backoff, RetryBudget
from sessionserve.agent.tools import ToolError, ToolRegistry

FAST = Backoff(base_s=0.001, max_s=0.002, max_attempts=3)


def sleepers() -> ToolRegistry:
    tools = ToolRegistry()

    def sleep_sync(ms: int) -> int:
        time.sleep(ms / 1000)
        return ms

    async def sleep_async(ms: int) -> int:
        await asyncio.sleep(ms / 1000)
        return ms

    tools.add(sleep_sync)
    tools.add(sleep_async)
    return tools


def make(tools: ToolRegistry, budget: RetryBudget | None = None, **kw: Any) -> ToolExecutor:
    return ToolExecutor(tools, budget=budget or RetryBudget(), backoff=kw.pop("backoff", FAST),
                        rng=random.Random(0), **kw)


def run(ex: ToolExecutor, calls: list[PlannedCall]) -> tuple[list[ToolResult], float]:
    return asyncio.run(ex.run_plan(calls))


@pytest.mark.parametrize("k", [1, 4, 16])
def test_step_costs_its_longest_call_not_the_sum(k: int) -> None:
    """Tool phase: <= 1.05 x max(d_i) for k independent mixed sync/async tools."""
    rng = random.Random(k)
    with make(sleepers()) as ex:
        for _ in range(3):  # best of three: a shared 2-core box can stall any one run
            ds = [rng.randint(100, 300) for _ in range(k)]
            calls = [PlannedCall(f"c{i}", "sleep_sync" if i % 2 else "sleep_async", {"ms": d})
                     for i, d in enumerate(ds)]
            t0 = time.monotonic()
            results, crit_s = run(ex, calls)
            wall_s = time.monotonic() - t0
            assert all(r.is_ok for r in results) and [r.value for r in results] == ds
            measured_max_s = max(r.record.duration_s for r in results)
            if wall_s <= 1.05 * measured_max_s:
                break
        assert wall_s <= 1.05 * measured_max_s, (wall_s, measured_max_s)
        assert crit_s == pytest.approx(measured_max_s)
        if k > 1:
            assert wall_s < 0.6 * sum(ds) / 1000


def test_sync_tools_are_not_limited_by_a_small_default_pool() -> None:
    """16 sync tools of one step all run at once: each waits until all 16 have started (asyncio's default
    pool, 6 threads on 2 cores, would leave 10 queued and the barrier would break)."""
    barrier = threading.Barrier(16, timeout=10.0)
    tools = ToolRegistry()

    def meet() -> int:
        return barrier.wait()

    tools.add(meet)
    with make(tools, backoff=Backoff(base_s=0.001, max_s=0.002, max_attempts=1)) as ex:
        results, _ = run(ex, [PlannedCall(f"c{i}", "meet", {}) for i in range(16)])
        assert all(r.is_ok for r in results), [r.error for r in results if not r.is_ok]
        assert sorted(r.value for r in results) == list(range(16))


def test_global_limit_one_runs_calls_one_after_another() -> None:
    with make(sleepers(), max_concurrent_calls=1) as ex:
        t0 = time.monotonic()
        results, crit_s = run(ex, [PlannedCall(f"c{i}", "sleep_async", {"ms": 30}) for i in range(4)])
        assert time.monotonic() - t0 >= 0.12
        starts = sorted(r.record.started_s for r in results)
        assert all(b - a >= 0.029 for a, b in zip(starts, starts[1:]))


def tracking_tools(log: list[tuple[str, str, float]], **options: Any) -> ToolRegistry:
    tools = ToolRegistry()

    async def step(name: str, ms: int = 40) -> str:
        log.append(("start", name, time.monotonic()))
        await asyncio.sleep(ms / 1000)
        log.append(("end", name, time.monotonic()))
        return name

    tools.add(step, **options)
    return tools


def test_plan_dependencies_run_in_order_and_independent_calls_overlap() -> None:
    log: list[tuple[str, str, float]] = []
    with make(tracking_tools(log)) as ex:
        calls = [PlannedCall("a", "step", {"name": "a"}), PlannedCall("b", "step", {"name": "b", "ms": 80}),
                 PlannedCall("c", "step", {"name": "c"}, after=("a",)),
                 PlannedCall("d", "step", {"name": "d"}, after=("b", "c"))]
        results, crit_s = run(ex, calls)
    at = {(ev, n): t for ev, n, t in log}
    assert at[("start", "c")] >= at[("end", "a")] and at[("start", "d")] >= max(at[("end", "b")], at[("end", "c")])
    assert at[("start", "b")] < at[("end", "a")]  # a and b overlapped
    assert [r.record.wave for r in results] == [0, 0, 1, 2]
    # c starts when a ends, not when the whole first wave (b) ends: no barrier between waves.
    assert at[("start", "c")] < at[("end", "b")]
    assert crit_s == pytest.approx(max(results[1].record.duration_s,
                                       results[0].record.duration_s + results[2].record.duration_s)
                                   + results[3].record.duration_s)


def test_tool_level_dependencies() -> None:
    log: list[tuple[str, str, float]] = []
    tools = tracking_tools(log)

    async def commit(msg: str) -> str:
        log.append(("start", "commit", time.monotonic()))
        return msg

    tools.add(commit, depends_on=("step",), is_idempotent=False)
    with make(tools) as ex:
        calls = [PlannedCall("x", "commit", {"msg": "m"}), PlannedCall("y", "step", {"name": "y"}),
                 PlannedCall("z", "step", {"name": "z"})]
        assert ex.dependencies(calls) == {"x": ("y", "z"), "y": (), "z": ()}
        results, _ = run(ex, calls)
    at = {(ev, n): t for ev, n, t in log}
    assert all(r.is_ok for r in results) and at[("start", "commit")] >= max(at[("end", "y")], at[("end", "z")])


def test_failed_dependency_skips_dependents() -> None:
    tools = ToolRegistry()

    def boom() -> None:
        raise ToolError("no", is_retryable=False)

    def after() -> str:
        raise AssertionError("must not run")

    tools.add(boom)
    tools.add(after)
    with make(tools) as ex:
        results, _ = run(ex, [PlannedCall("a", "boom"), PlannedCall("b", "after", after=("a",))])
    assert not results[1].is_ok and "dependency a failed" in results[1].error
    assert results[1].record.num_attempts == 0


def test_bad_plans_are_rejected_before_running() -> None:
    with make(sleepers()) as ex:
        with pytest.raises(ValueError, match="cycle"):
            run(ex, [PlannedCall("a", "sleep_async", {"ms": 1}, after=("b",)),
                     PlannedCall("b", "sleep_async", {"ms": 1}, after=("a",))])
        with pytest.raises(ValueError, match="duplicate"):
            run(ex, [PlannedCall("a", "sleep_async", {"ms": 1}), PlannedCall("a", "sleep_async", {"ms": 1})])


@pytest.mark.parametrize("is_async", [True, False])
def test_timeout_cuts_the_wait(is_async: bool) -> None:
    tools = ToolRegistry()
    if is_async:
        async def slow() -> None:
            await asyncio.sleep(2)
    else:
        def slow() -> None:
            time.sleep(0.5)
    tools.add(slow, timeout_s=0.05, is_idempotent=False)
    with make(tools) as ex:
        t0 = time.monotonic()
        (result,), _ = run(ex, [PlannedCall("a", "slow")])
        assert time.monotonic() - t0 < 0.4
    assert not result.is_ok and "timed out after 0.05 s" in result.error
    assert result.content().startswith("ERROR:")


def test_per_tool_concurrency_limit() -> None:
    in_flight, peak = [0], [0]
    lock = threading.Lock()
    tools = ToolRegistry()

    def limited() -> None:
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        time.sleep(0.03)
        with lock:
            in_flight[0] -= 1

    tools.add(limited, max_concurrency=2)
    with make(tools) as ex:
        results, _ = run(ex, [PlannedCall(f"c{i}", "limited") for i in range(6)])
    assert peak[0] == 2 and all(r.is_ok for r in results)
    assert sum(r.record.queued_s for r in results) > 0.05  # queueing is recorded apart from running


def flaky_tools(fail_times: int, calls: list[float], **options: Any) -> ToolRegistry:
    tools = ToolRegistry()

    def flaky(error: Callable[[], Exception] = lambda: RuntimeError("down")) -> str:
        calls.append(time.monotonic())
        if len(calls) <= fail_times:
            raise error()
        return "ok"

    def flaky_tool() -> str:
        return flaky()

    tools.add(flaky_tool, name="flaky", **options)
    return tools


def test_idempotent_tool_retried_with_backoff_within_budget() -> None:
    calls: list[float] = []
    budget = RetryBudget()
    with make(flaky_tools(2, calls), budget) as ex:
        (result,), _ = run(ex, [PlannedCall("a", "flaky")])
    assert result.is_ok and result.record.num_attempts == 3 and len(calls) == 3
    assert budget.num_requests == 1 and budget.num_retries == 2


def test_non_idempotent_tool_never_retried() -> None:
    calls: list[float] = []
    budget = RetryBudget()
    with make(flaky_tools(1, calls, is_idempotent=False), budget) as ex:
        (result,), _ = run(ex, [PlannedCall("a", "flaky")])
    assert not result.is_ok and len(calls) == 1 and budget.num_retries == 0 and "RuntimeError: down" in result.error


def test_non_retryable_tool_error_not_retried() -> None:
    tools = ToolRegistry()
    calls = []

    def bad() -> None:
        calls.append(1)
        raise ToolError("bad input", is_retryable=False)

    tools.add(bad)
    with make(tools) as ex:
        (result,), _ = run(ex, [PlannedCall("a", "bad")])
    assert len(calls) == 1 and result.error == "ToolError: bad input"


def test_spent_budget_stops_tool_retries() -> None:
    calls: list[float] = []
    budget = RetryBudget(ratio=0.0, min_retries_per_s=0.0)
    with make(flaky_tools(1, calls), budget) as ex:
        (result,), _ = run(ex, [PlannedCall("a", "flaky")])
    assert not result.is_ok and len(calls) == 1 and budget.num_denied == 1


def test_retry_after_from_the_tool_is_honoured() -> None:
    tools = ToolRegistry()
    calls: list[float] = []

    def rate_limited() -> str:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise ToolError("slow down", retry_after_s=0.1)
        return "ok"

    tools.add(rate_limited)
    with make(tools) as ex:
        (result,), _ = run(ex, [PlannedCall("a", "rate_limited")])
    assert result.is_ok and calls[1] - calls[0] >= 0.1


def test_breaker_opens_and_fails_fast() -> None:
    calls: list[float] = []
    with make(flaky_tools(10**6, calls), breaker=BreakerConfig(failure_threshold=3, open_s=60.0),
              backoff=Backoff(base_s=0.001, max_s=0.001, max_attempts=2)) as ex:
        first, _ = run(ex, [PlannedCall("a", "flaky"), PlannedCall("b", "flaky")])
        assert len(calls) == 4 and all(not r.is_ok for r in first)
        later, _ = run(ex, [PlannedCall("c", "flaky")])
        assert len(calls) == 4 and "circuit open" in later[0].error and later[0].record.num_attempts == 0


def test_repeated_failed_call_draws_from_the_budget() -> None:
    calls: list[float] = []
    budget = RetryBudget(ratio=0.0, min_retries_per_s=0.1, window_s=10.0)  # one retry per window
    with make(flaky_tools(0, calls), budget) as ex:
        ok, _ = run(ex, [PlannedCall("a", "flaky", is_retry=True)])
        refused, _ = run(ex, [PlannedCall("b", "flaky", is_retry=True)])
    assert ok[0].is_ok and budget.num_retries == 1 and budget.num_requests == 0
    assert not refused[0].is_ok and "retry budget" in refused[0].error and len(calls) == 1


def test_unknown_tool_and_bad_arguments_are_reported_not_raised() -> None:
    with make(sleepers()) as ex:
        results, _ = run(ex, [PlannedCall("a", "nope"), PlannedCall("b", "sleep_async", '{"ms": "x"}')])
    assert "unknown tool 'nope'" in results[0].error and "invalid arguments" in results[1].error
    assert all(r.record.num_attempts == 0 for r in results)


def test_estimator_learns_and_executor_survives_new_event_loops() -> None:
    tools = sleepers()
    tools.add(lambda: "x", name="limited", max_concurrency=1)
    with make(tools) as ex:
        for _ in range(2):  # a second asyncio.run needs fresh semaphores
            results, _ = run(ex, [PlannedCall("a", "sleep_async", {"ms": 20}), PlannedCall("b", "limited")])
            assert all(r.is_ok for r in results)
        assert 0.015 < ex.estimator.estimate_s("sleep_async") < 0.1


def test_result_content() -> None:
    with make(sleepers()) as ex:
        results, _ = run(ex, [PlannedCall("a", "sleep_async", {"ms": 1})])
    assert results[0].content() == "1"
