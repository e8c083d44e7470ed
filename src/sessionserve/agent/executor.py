"""Runs a step's tool calls: concurrently, in dependency order, under timeouts, limits, retries and breakers.

Every call of a step starts as soon as the calls it depends on have ended
(dataflow over the topological waves of `graph.py`, with no barrier between
waves), so the tool phase costs its critical path rather than the sum of its
calls. Async tools run on the event loop; sync tools on a thread pool owned
by the executor.

NOTE: the pool is sized for waiting, not computing (tools mostly wait on
I/O): asyncio's default pool has min(32, cpus + 4) threads, 6 on a 2-core
box, which would serialise a step of 16 sync tools into three rounds. Its
threads are started up front: a pool starts a thread inside `submit`, and
waits for it to run, which on a loaded machine put ~1 ms per new thread on
the critical path of the first big step.

Retries: only idempotent tools, only for retryable errors, with backoff
(Retry-After from a `ToolError` is a floor) and only while the shared
`RetryBudget` allows. A call the model repeats after it failed is itself a
retry and draws from the budget before it runs. Non-idempotent tools are
never retried here: their error goes back to the model.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sessionserve.agent.breaker import BreakerConfig, CircuitBreaker
from sessionserve.agent.graph import critical_path_s, topological_waves
from sessionserve.agent.latency import LatencyEstimator
from sessionserve.agent.retry import Backoff, RetryBudget
from sessionserve.agent.timing import ToolCallRecord
from sessionserve.agent.tools import Tool, ToolError, ToolRegistry
from sessionserve.obs.cpu_roles import TOOLS, RolePool


@dataclass(frozen=True)
class PlannedCall:
    """A tool call to run: `after` names calls (by id) of the same plan that must end first."""

    call_id: str
    name: str
    arguments: str | dict[str, Any] = "{}"
    after: tuple[str, ...] = ()
    is_retry: bool = False  # a repeat of a call that failed before: draws from the retry budget


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one logical call (after any retries)."""

    call_id: str
    name: str
    is_ok: bool
    value: Any
    error: str | None
    record: ToolCallRecord

    def content(self) -> str:
        """The text of the `tool` message sent back to the model; errors start with 'ERROR:'."""
        if not self.is_ok:
            return f"ERROR: {self.error}"
        if isinstance(self.value, str):
            return self.value
        return json.dumps(self.value, default=str)


class ToolExecutor:
    """Runs plans of tool calls for one or many agents. Owns a thread pool: `close()` it (or use `with`)."""

    def __init__(self, registry: ToolRegistry, *, budget: RetryBudget, backoff: Backoff | None = None,
                 breaker: BreakerConfig | None = None, estimator: LatencyEstimator | None = None,
                 max_workers: int = 64, num_warm_threads: int = 16, max_concurrent_calls: int | None = None,
                 rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic,
                 cpus: frozenset[int] | None = None) -> None:
        """`max_concurrent_calls`: calls of all tools in flight at once (None: no limit; 1: one after another).

        `cpus`: cores the tool threads (and the processes tools start) are pinned to, so tool work does
        not take the engine's cores; `meter` reports the pool's busy time (the `tools` CPU role).
        """
        self.registry = registry
        self.budget = budget
        self.backoff = backoff or Backoff()
        self.breaker_config = breaker or BreakerConfig()
        self.estimator = estimator or LatencyEstimator()
        self.rng = rng or random.Random()
        self.clock = clock
        self.max_concurrent_calls = max_concurrent_calls
        self._pool = RolePool(TOOLS, max_workers, cpus)
        self.meter = self._pool.meter
        self._warm(min(num_warm_threads, max_workers))
        self._breakers: dict[str, CircuitBreaker] = {}
        self._semaphores: dict[str, asyncio.Semaphore] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def __enter__(self) -> ToolExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _warm(self, num_threads: int) -> None:
        # Each task blocks until all have started, so the pool must start one thread per task.
        if num_threads < 1:
            return
        barrier = threading.Barrier(num_threads)
        for _ in range(num_threads):
            self._pool.submit_unmetered(_wait_at, barrier)  # not tool work

    def breaker(self, name: str) -> CircuitBreaker:
        if name not in self._breakers:
            self._breakers[name] = CircuitBreaker(self.breaker_config)
        return self._breakers[name]

    def dependencies(self, calls: list[PlannedCall]) -> dict[str, tuple[str, ...]]:
        """Call id -> ids it waits for: the plan's own `after`, plus tool-level `depends_on` within the plan."""
        by_tool: dict[str, list[str]] = {}
        for c in calls:
            by_tool.setdefault(c.name, []).append(c.call_id)
        deps: dict[str, tuple[str, ...]] = {}
        for c in calls:
            tool = self.registry.get(c.name)
            wait = list(c.after)
            for dep_tool in tool.depends_on if tool else ():
                wait += [cid for cid in by_tool.get(dep_tool, []) if cid != c.call_id]
            deps[c.call_id] = tuple(dict.fromkeys(wait))
        return deps

    async def run_plan(self, calls: list[PlannedCall],
                       on_result: Callable[[ToolResult], None] | None = None) -> tuple[list[ToolResult], float]:
        """Run every call; return results in input order and the plan's critical path (s).

        Raises ValueError for duplicate ids, unknown `after` ids or a cycle,
        before anything runs. A call whose dependency failed is not run.
        """
        ids = [c.call_id for c in calls]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate call ids in plan")
        deps = self.dependencies(calls)
        wave_of = {cid: i for i, wave in enumerate(topological_waves(deps)) for cid in wave}
        self._bind_loop()
        futures: dict[str, asyncio.Future[ToolResult]] = {}

        async def one(call: PlannedCall) -> ToolResult:
            upstream = [await futures[d] for d in deps[call.call_id]]
            rec = ToolCallRecord(call.call_id, call.name, wave=wave_of[call.call_id], is_retry=call.is_retry)
            failed = [r.call_id for r in upstream if not r.is_ok]
            if failed:
                rec.ready_s = rec.started_s = rec.finished_s = self.clock()
                result = self._fail(call, rec, f"not run: dependency {failed[0]} failed")
            else:
                result = await self._run_call(call, rec)
            if on_result is not None:
                on_result(result)
            return result

        for call in calls:  # futures exist before any task awaits them
            futures[call.call_id] = asyncio.ensure_future(one(call))
        results = list(await asyncio.gather(*futures.values()))
        durations_s = {r.call_id: r.record.duration_s for r in results}
        return results, critical_path_s(deps, durations_s)

    def _bind_loop(self) -> None:
        # asyncio primitives belong to one loop; an agent reused under a new asyncio.run gets fresh ones.
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop, self._semaphores = loop, {}

    def _semaphores_for(self, tool: Tool) -> list[asyncio.Semaphore]:
        """The limits a call of `tool` must pass, always in the same order (tool, then global): no deadlock."""
        limits = [(tool.name, tool.max_concurrency), ("", self.max_concurrent_calls)]
        for key, limit in limits:
            if limit is not None and key not in self._semaphores:
                self._semaphores[key] = asyncio.Semaphore(limit)
        return [self._semaphores[key] for key, limit in limits if limit is not None]

    def _fail(self, call: PlannedCall, rec: ToolCallRecord, error: str) -> ToolResult:
        rec.is_ok, rec.error = False, error
        return ToolResult(call.call_id, call.name, False, None, error, rec)

    async def _run_call(self, call: PlannedCall, rec: ToolCallRecord) -> ToolResult:
        rec.ready_s = self.clock()
        tool = self.registry.get(call.name)
        if tool is None:
            rec.started_s = rec.finished_s = rec.ready_s
            return self._fail(call, rec, f"unknown tool {call.name!r}; available: {self.registry.names()}")
        try:
            args = tool.parse_arguments(call.arguments)
        except ToolError as exc:
            rec.started_s = rec.finished_s = rec.ready_s
            return self._fail(call, rec, str(exc))
        sems = self._semaphores_for(tool)
        for i, sem in enumerate(sems):
            try:
                await sem.acquire()
            except BaseException:  # cancelled while queued: give back what was taken
                for taken in sems[:i]:
                    taken.release()
                raise
        try:
            rec.started_s = self.clock()
            result = await self._attempts(tool, call, args, rec)
            rec.finished_s = self.clock()
            if rec.num_attempts:  # a call refused before running says nothing about how long the tool takes
                self.estimator.observe(tool.name, rec.duration_s)
            return result
        finally:
            for sem in sems:
                sem.release()

    async def _attempts(self, tool: Tool, call: PlannedCall, args: dict[str, Any],
                        rec: ToolCallRecord) -> ToolResult:
        if call.is_retry:
            if not self.budget.try_acquire_retry(self.clock()):
                return self._fail(call, rec, "not run: the retry budget is spent (the tool failed before)")
        else:
            self.budget.record_request(self.clock())
        breaker = self.breaker(tool.name)
        num_failed = 0
        while True:
            if not breaker.allow(self.clock()):
                return self._fail(call, rec, f"not run: tool {tool.name!r} is failing (circuit open)")
            rec.num_attempts += 1
            try:
                value = await self._invoke(tool, args)
            except Exception as exc:  # noqa: BLE001 - any tool failure is reported, never raised into the loop
                breaker.record_failure(self.clock())
                num_failed += 1
                error = _describe(exc, tool)
                is_retryable = tool.is_idempotent and getattr(exc, "is_retryable", True)
                delay_s = self.backoff.delay_s(num_failed, self.rng, getattr(exc, "retry_after_s", None)) \
                    if is_retryable else None
                if delay_s is None or not self.budget.try_acquire_retry(self.clock()):
                    return self._fail(call, rec, error)
                await asyncio.sleep(delay_s)
                continue
            breaker.record_success(self.clock())
            rec.is_ok = True
            return ToolResult(call.call_id, call.name, True, value, None, rec)

    async def _invoke(self, tool: Tool, args: dict[str, Any]) -> Any:
        if tool.is_async:
            work = tool.fn(**args)
        else:
            ctx = contextvars.copy_context()
            work = asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(ctx.run, tool.fn, **args))
        # NOTE: a timed-out sync tool keeps its thread until it returns; only the wait is cut short.
        return await asyncio.wait_for(work, tool.timeout_s)


def _wait_at(barrier: threading.Barrier) -> None:
    try:
        barrier.wait(timeout=10.0)
    except threading.BrokenBarrierError:
        pass  # the pool is only slower to warm


def _describe(exc: BaseException, tool: Tool) -> str:
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return f"{tool.name} timed out after {tool.timeout_s} s"
    return f"{type(exc).__name__}: {exc}"
