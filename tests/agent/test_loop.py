"""The agent loop against a plain OpenAI-compatible fake endpoint: steps, concurrency, re-plans, budget, spans."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import pytest
from fastapi import FastAPI
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sessionserve.agent import (Agent, AgentConfig, Backoff, BreakerConfig, ChatClient, RetryBudget, RunDone,
                                StepDone, TextDelta, ToolDone, ToolExecutor, ToolRegistry)
from sessionserve.agent.fake_endpoint import FakeModelConfig, make_app, serve

FAST = dict(base_s=0.001, max_s=0.002)
NO_BREAKER = BreakerConfig(failure_threshold=10**9)  # to see the budget alone


def script(*steps: list[tuple[str, dict[str, Any]]]) -> str:
    return json.dumps({"steps": [[{"name": n, "arguments": a} for n, a in step] for step in steps]})


def sleep_tools() -> ToolRegistry:
    tools = ToolRegistry()

    def sleep_sync(ms: int) -> str:
        time.sleep(ms / 1000)
        return f"slept {ms}"

    async def sleep_async(ms: int) -> str:
        await asyncio.sleep(ms / 1000)
        return f"slept {ms}"

    tools.add(sleep_sync)
    tools.add(sleep_async)
    return tools


def agent_for(url: str, tools: ToolRegistry, budget: RetryBudget | None = None, **config: Any) -> Agent:
    budget = budget or RetryBudget()
    executor = ToolExecutor(tools, budget=budget, backoff=Backoff(max_attempts=config.pop("tool_attempts", 3), **FAST),
                            breaker=config.pop("breaker", None), max_concurrent_calls=config.pop("max_calls", None),
                            rng=random.Random(0))
    client = ChatClient(url, "sk", budget=budget, backoff=Backoff(max_attempts=4, **FAST), rng=random.Random(0))
    provider = config.pop("tp", None)
    return Agent(client, tools, AgentConfig(**config), executor=executor, tracer_provider=provider)


def run(agent: Agent, task: str, **kw: Any) -> Any:
    async def main() -> Any:
        try:
            return await agent.run(task, **kw)
        finally:
            agent.close()
            await agent.client.aclose()
    return asyncio.run(main())


def test_step_latency_is_the_longest_tool_plus_model_time(fake: tuple[str, FastAPI]) -> None:
    """16 independent tools cost <= 1.05 x max(d_i) + model time; one by one ~ sum(d_i)."""
    url, _ = fake
    rng = random.Random(16)
    agent = agent_for(url, sleep_tools())

    async def main() -> None:
        for _ in range(3):  # best of three on a shared machine
            ds = [rng.randint(100, 300) for _ in range(16)]
            task = script([("sleep_sync" if i % 2 else "sleep_async", {"ms": d}) for i, d in enumerate(ds)])
            result = await agent.run(task)
            step = result.steps[0]
            measured_max_s = max(c.duration_s for c in step.tool_calls)
            if step.step_s <= 1.05 * measured_max_s + step.model_s:
                break
        assert len(step.tool_calls) == 16 and all(c.is_ok for c in step.tool_calls)
        assert step.step_s <= 1.05 * measured_max_s + step.model_s, step.summary()
        assert step.step_s < 0.3 * sum(ds) / 1000
        assert result.stop_reason == "answer" and result.answer == "done"
        agent.close()
        await agent.client.aclose()

    asyncio.run(main())


def test_sequential_execution_costs_the_sum(fake: tuple[str, FastAPI]) -> None:
    url, _ = fake
    ds = [20, 40, 30, 50, 25, 35, 45, 15]
    result = run(agent_for(url, sleep_tools(), max_calls=1), script([("sleep_async", {"ms": d}) for d in ds]))
    step = result.steps[0]
    assert sum(ds) / 1000 <= step.tools_s <= 1.05 * step.sum_tool_s + 0.01
    assert step.queued_s > 0.1  # the calls waited on the limit, not on each other: the DAG path is still max(d)


def test_multi_step_run_builds_the_conversation(fake: tuple[str, FastAPI]) -> None:
    url, app = fake
    task = script([("sleep_async", {"ms": 1}), ("sleep_sync", {"ms": 2})], [("sleep_async", {"ms": 3})])
    result = run(agent_for(url, sleep_tools()), task)
    assert result.stop_reason == "answer" and result.session_id is None and len(result.steps) == 3
    roles = [m["role"] for m in result.messages]
    assert roles == ["user", "assistant", "tool", "tool", "assistant", "tool", "assistant"]
    first = result.messages[1]["tool_calls"]
    assert [m["tool_call_id"] for m in result.messages[2:4]] == [c["id"] for c in first]
    assert [m["content"] for m in result.messages[2:4]] == ["slept 1", "slept 2"]
    assert result.num_tool_calls == 3


def test_step_limit(fake: tuple[str, FastAPI]) -> None:
    url, _ = fake
    task = script(*[[("sleep_async", {"ms": 1})]] * 5)
    result = run(agent_for(url, sleep_tools(), max_steps=2), task)
    assert result.stop_reason == "max_steps" and len(result.steps) == 2 and result.answer is None


def test_tool_choice_per_step(fake: tuple[str, FastAPI]) -> None:
    url, app = fake
    task = script([("sleep_async", {"ms": 1})], [("sleep_async", {"ms": 1})])
    n0 = len(app.state.requests)
    run(agent_for(url, sleep_tools(), tool_choice=["required", {"type": "function",
                                                                "function": {"name": "sleep_async"}}]), task)
    n1 = len(app.state.requests)
    run(agent_for(url, sleep_tools(), tool_choice=lambda step: "required" if step == 0 else "auto"), task)
    sent = [body.get("tool_choice") for _, body in app.state.requests[n0:]]
    assert sent[:n1 - n0] == ["required", {"type": "function", "function": {"name": "sleep_async"}}, "auto"]
    assert sent[n1 - n0:] == ["required", "auto", "auto"]


def test_stream_events(fake: tuple[str, FastAPI]) -> None:
    url, _ = fake
    agent = agent_for(url, sleep_tools(), stream=True)

    async def main() -> list[Any]:
        events = [e async for e in agent.stream(script([("sleep_async", {"ms": 1}), ("sleep_sync", {"ms": 1})]))]
        agent.close()
        await agent.client.aclose()
        return events

    events = asyncio.run(main())
    kinds = [type(e).__name__ for e in events]
    assert kinds[:2] == ["ToolDone", "ToolDone"] and kinds[2] == "StepDone" and kinds[-1] == "RunDone"
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    result = events[-1].result
    assert isinstance(events[-1], RunDone) and text == result.answer == "done "
    assert all(e.result.is_ok for e in events if isinstance(e, ToolDone))
    assert sum(isinstance(e, StepDone) for e in events) == 2


def failing_tools(fail_rate: float, counter: list[int], seed: int = 0, **options: Any) -> ToolRegistry:
    rng = random.Random(seed)
    tools = ToolRegistry()

    def flaky(x: int) -> str:
        counter.append(x)
        if rng.random() < fail_rate:
            raise RuntimeError("dependency down")
        return "ok"

    tools.add(flaky, **options)
    return tools


def test_replan_after_failure_draws_from_the_budget(fake: tuple[str, FastAPI]) -> None:
    url, app = fake
    attempts: list[int] = []
    budget = RetryBudget(ratio=0.0, min_retries_per_s=0.1, window_s=10.0)  # one retry in the window
    n0 = len(app.state.requests)
    result = run(agent_for(url, failing_tools(1.0, attempts, is_idempotent=False), budget),
                 script([("flaky", {"x": 1})]))
    bodies = [b for _, b in app.state.requests[n0:]]
    # plan -> tool fails -> re-plan (the one retry) -> repeat refused by the budget -> answer without tools
    assert result.num_replans == 1 and result.steps[1].is_replan and len(attempts) == 1
    assert "retry budget" in result.messages[4]["content"]
    assert [b["tool_choice"] for b in bodies] == ["auto", "auto", "none"]
    assert result.stop_reason == "answer" and budget.num_retries == 1 and budget.num_requests == 3


def test_non_idempotent_failure_goes_to_the_model(fake: tuple[str, FastAPI]) -> None:
    url, _ = fake
    attempts: list[int] = []
    result = run(agent_for(url, failing_tools(1.0, attempts, is_idempotent=False), max_replans=0),
                 script([("flaky", {"x": 1})]))
    assert len(attempts) == 1 and result.messages[2]["content"] == "ERROR: RuntimeError: dependency down"
    assert result.stop_reason == "answer" and result.num_replans == 0


def amplification(url: str, app: FastAPI, fail_rate: float, budget: RetryBudget, num_runs: int,
                  **config: Any) -> float:
    """Total attempts (tool + model HTTP) per run, over the 3 a run costs with no failure."""
    attempts: list[int] = []
    config.setdefault("breaker", NO_BREAKER)
    agent = agent_for(url, failing_tools(fail_rate, attempts, seed=1), budget, max_replans=2, **config)
    task = script([("flaky", {"x": 1})])
    n0 = len(app.state.requests)

    async def main() -> None:
        sem = asyncio.Semaphore(10)

        async def one() -> None:
            async with sem:
                await agent.run(task)

        await asyncio.gather(*[one() for _ in range(num_runs)])
        agent.close()
        await agent.client.aclose()

    asyncio.run(main())
    return (len(attempts) + len(app.state.requests) - n0) / (3 * num_runs)


@pytest.mark.parametrize("fail_rate", [1.0, 0.3])
def test_budget_bounds_amplification_across_layers(fake: tuple[str, FastAPI], fail_rate: float) -> None:
    """Retry budget: <= 1.1x the no-failure attempts with the budget; naive nested retries ~ 9x at the tool."""
    url, app = fake
    ours = amplification(url, app, fail_rate, RetryBudget(ratio=0.1, min_retries_per_s=0.5, window_s=10.0), 60)
    assert ours <= 1.1 + 1e-9, ours
    if fail_rate == 1.0:
        attempts: list[int] = []
        naive = agent_for(url, failing_tools(1.0, attempts), RetryBudget.unlimited(), max_replans=2,
                          breaker=NO_BREAKER)
        result = run(naive, script([("flaky", {"x": 1})]))
        assert len(attempts) == 9 and len(result.steps) == 4  # 3 tries x 3 plans, then an answer
        assert result.num_replans == 2


def test_breaker_turns_a_dead_tool_into_fast_failures(fake: tuple[str, FastAPI]) -> None:
    url, app = fake
    ratio = amplification(url, app, 1.0, RetryBudget(), 40, breaker=BreakerConfig(failure_threshold=3, open_s=60))
    assert ratio < 0.9  # most calls never reach the dead tool


def test_failing_model_endpoint_is_bounded_by_the_same_budget() -> None:
    app = make_app(FakeModelConfig(fail_rate=1.0, fail_status=503, retry_after_s=0))
    budget = RetryBudget(ratio=0.1, min_retries_per_s=0.0, window_s=10.0)
    with serve(app) as url:
        agent = agent_for(url, sleep_tools(), budget)

        async def main() -> list[Any]:
            out = await asyncio.gather(*[agent.run("hi") for _ in range(50)])
            agent.close()
            await agent.client.aclose()
            return out

        results = asyncio.run(main())
    assert all(r.stop_reason == "model_error" and "503" in r.error for r in results)
    assert len(app.state.requests) <= 55  # 50 logical calls + 10% retries


def test_spans_per_run_step_model_and_tool(fake: tuple[str, FastAPI]) -> None:
    url, _ = fake
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    agent = agent_for(url, sleep_tools(), tp=provider)
    run(agent, script([("sleep_async", {"ms": 20}), ("sleep_sync", {"ms": 10})]))
    spans = {s.name: [] for s in exporter.get_finished_spans()}
    for s in exporter.get_finished_spans():
        spans[s.name].append(s)
    assert len(spans["agent.run"]) == 1 and len(spans["agent.step"]) == 2 and len(spans["agent.model"]) == 2
    tools = spans["agent.tool"]
    assert sorted(s.attributes["gen_ai.tool.name"] for s in tools) == ["sleep_async", "sleep_sync"]
    run_span, step0 = spans["agent.run"][0], min(spans["agent.step"], key=lambda s: s.start_time)
    assert step0.parent.span_id == run_span.context.span_id
    assert all(t.parent.span_id == step0.context.span_id for t in tools)
    assert 0.019 < (max(t.end_time for t in tools) - min(t.start_time for t in tools)) / 1e9 < 0.2
    assert step0.attributes["agent.critical_path_s"] >= 0.019 and run_span.attributes["agent.stop_reason"] == "answer"


def test_client_and_executor_must_share_the_budget(fake: tuple[str, FastAPI]) -> None:
    url, _ = fake
    tools = sleep_tools()
    with ToolExecutor(tools, budget=RetryBudget()) as ex, pytest.raises(ValueError, match="one RetryBudget"):
        Agent(ChatClient(url, budget=RetryBudget()), tools, executor=ex)
