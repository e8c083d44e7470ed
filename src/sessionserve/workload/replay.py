"""The replay driver: agent sessions from a trace against a `Backend`, closed or open loop.

Closed loop: `concurrency` agents; each takes the next session in trace order,
runs it step by step, sleeping each step's (scaled) tool wait in between.
Open loop: session k starts at its arrival time, Poisson at `rate_per_s` or
the trace's own arrivals, however many are already running. Token ids come
from a `PromptBuilder` seeded with `seed`, so a trace and a seed fix the
request sequence; only timing differs between runs.

Sub-agents (`AgentSession.subagents`) start as their own sessions when the
parent's step before them ends, concurrently with each other; the parent waits
for the blocking ones, then for its step's own tool calls. They are recorded
apart (`ReplayResult.subagents`), so sessions/hour and JCT count whole tasks
while their steps count with everyone's.

Backends: `InprocBackend(engine)` and `HttpBackend(url, api_key, supports_sessions)`.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sessionserve.workload.backend import Backend, StepResult
from sessionserve.workload.http_backend import HttpBackend
from sessionserve.workload.inproc import InprocBackend
from sessionserve.workload.prompts import PromptBuilder
from sessionserve.workload.trace import AgentSession

__all__ = ["Backend", "HttpBackend", "InprocBackend", "LoadSpec", "ReplayResult", "poisson_arrivals", "replay"]

KV_SAMPLE_PERIOD_S = 0.25


@dataclass(frozen=True)
class LoadSpec:
    """Offered load: `closed` with `concurrency` agents, or `open` at `rate_per_s` (None: the trace's arrivals)."""

    mode: str = "closed"
    concurrency: int = 4
    rate_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("closed", "open"):
            raise ValueError(f"mode must be closed|open, got {self.mode!r}")
        if self.mode == "closed" and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.rate_per_s is not None and self.rate_per_s <= 0:
            raise ValueError("rate_per_s must be positive")

    @property
    def level(self) -> float:
        """The load as one number for plots: agents (closed) or sessions per second (open; 0 = trace)."""
        return float(self.concurrency) if self.mode == "closed" else float(self.rate_per_s or 0.0)

    @property
    def label(self) -> str:
        if self.mode == "closed":
            return f"{self.concurrency} agent{'' if self.concurrency == 1 else 's'}"
        return f"{self.rate_per_s:g} sessions/s" if self.rate_per_s else "trace arrivals"


@dataclass(slots=True)
class StepRecord:
    session_id: str
    step_index: int
    start_s: float  # since the replay began
    num_new_tokens: int
    result: StepResult


@dataclass(slots=True)
class SessionRecord:
    session_id: str
    arrival_s: float  # since the replay began: scheduled arrival (open) or start (closed)
    start_s: float
    end_s: float | None = None  # None: failed
    num_steps: int = 0
    total_wait_s: float = 0.0  # tool/human waits slept
    error: str | None = None
    stats: dict[str, float] = field(default_factory=dict)
    priority: str = "interactive"  # the session's scheduling class

    @property
    def jct_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.arrival_s


@dataclass
class ReplayResult:
    load: LoadSpec
    sessions: list[SessionRecord]
    steps: list[StepRecord]
    kv_samples: list[dict[str, float]]  # {"t_s": ..., "device_bytes": ..., ...}
    makespan_s: float
    busy_s: float | None  # server time stepping with work (inproc only)
    cpu_s: float | None  # this process's CPU time (inproc: the engine's)
    num_cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    extra: dict[str, float] = field(default_factory=dict)  # backend checks added by the caller (leaked blocks)
    subagents: list[SessionRecord] = field(default_factory=list)  # sessions' sub-agents (their steps are in `steps`)


def pool_results(results: Sequence[ReplayResult]) -> ReplayResult:
    """Runs of independent replicas side by side, as one fleet's: sessions and steps pooled, the makespan
    the longest (so sessions/hour is the fleet's). One run is returned as it is."""
    first = results[0]
    if len(results) == 1:
        return first
    return ReplayResult(first.load, [s for r in results for s in r.sessions], [x for r in results for x in r.steps],
                        [], max(r.makespan_s for r in results), None, None,
                        subagents=[s for r in results for s in r.subagents])


def poisson_arrivals(num_sessions: int, rate_per_s: float, seed: int) -> list[float]:
    """Arrival times (s) of a Poisson process at `rate_per_s`, first at 0. Pure in (n, rate, seed)."""
    rng = random.Random(f"arrivals:{seed}")
    times, t = [], 0.0
    for _ in range(num_sessions):
        times.append(t)
        t += rng.expovariate(rate_per_s)
    return times


def arrival_times(sessions: Sequence[AgentSession], load: LoadSpec, seed: int) -> list[float] | None:
    """When each session starts (s), or None for closed loop. Trace arrivals need `arrival_s` on every session."""
    if load.mode == "closed":
        return None
    if load.rate_per_s is not None:
        return poisson_arrivals(len(sessions), load.rate_per_s, seed)
    if any(s.arrival_s is None for s in sessions):
        raise ValueError("this trace has no arrival times: give an open-loop rate or use a closed loop")
    t0 = min(s.arrival_s or 0.0 for s in sessions)
    return [(s.arrival_s or 0.0) - t0 for s in sessions]


async def replay(backend: Backend, sessions: Sequence[AgentSession], load: LoadSpec, *, seed: int = 0,
                 on_session_done: Callable[[SessionRecord], None] | None = None) -> ReplayResult:
    """Replay `sessions` through `backend` (started and stopped here) under `load`."""
    builder = PromptBuilder(backend.vocab_size, seed)
    records: list[SessionRecord] = []
    steps: list[StepRecord] = []
    kv_samples: list[dict[str, float]] = []
    await backend.start()
    t_start, cpu0 = time.monotonic(), time.process_time()

    def now() -> float:
        return time.monotonic() - t_start

    subagents: list[SessionRecord] = []
    background: list[asyncio.Task] = []

    async def run_session(trace: AgentSession, arrival_s: float, *, into: list[SessionRecord] = records) -> None:
        rec = SessionRecord(trace.session_id, arrival_s, now(), priority=trace.priority)
        into.append(rec)
        try:
            await backend.open_session(trace.session_id, trace.priority)
            for k, step in enumerate(trace.steps):
                ids = builder.step_tokens(trace.session_id, k, step)
                start_s = now()
                res = await backend.generate(trace.session_id, k, ids, step.output_tokens, step.context_kept_tokens)
                steps.append(StepRecord(trace.session_id, k, start_s, len(ids), res))
                rec.num_steps += 1
                if k + 1 < len(trace.steps):
                    wait_from = now()
                    await backend.park(trace.session_id, step.tool_names, trace.expected_wait_s(k))
                    children = trace.subagents_after(k)
                    tasks = [(a, asyncio.create_task(run_session(a.session, now(), into=subagents)))
                             for a in children]
                    background.extend(t for a, t in tasks if not a.blocking)
                    await asyncio.gather(*(t for a, t in tasks if a.blocking))
                    await asyncio.sleep(step.wait_s)
                    rec.total_wait_s += now() - wait_from if children else step.wait_s
            rec.end_s = now()
        except Exception as exc:  # noqa: BLE001 - one failed session must not end the run; it is counted
            rec.error = f"{type(exc).__name__}: {exc}"
        finally:
            try:
                rec.stats = await backend.close_session(trace.session_id)
            except Exception as exc:  # noqa: BLE001
                rec.error = rec.error or f"close: {type(exc).__name__}: {exc}"
        if on_session_done is not None and into is records:
            on_session_done(rec)

    async def sample_kv(done: asyncio.Event) -> None:
        while not done.is_set():
            usage = backend.kv_usage()
            if usage is not None:
                kv_samples.append({"t_s": round(now(), 3), **usage})
            try:
                await asyncio.wait_for(done.wait(), KV_SAMPLE_PERIOD_S)
            except asyncio.TimeoutError:
                pass

    done = asyncio.Event()
    sampler = asyncio.create_task(sample_kv(done))
    try:
        arrivals = arrival_times(sessions, load, seed)
        if arrivals is None:
            queue = list(sessions)

            async def agent() -> None:
                while queue:
                    await run_session(queue.pop(0), now())

            await asyncio.gather(*(agent() for _ in range(min(load.concurrency, len(sessions)))))
        else:
            async def start_at(trace: AgentSession, at_s: float) -> None:
                await asyncio.sleep(max(0.0, at_s - now()))
                await run_session(trace, at_s)

            await asyncio.gather(*(start_at(s, a) for s, a in zip(sessions, arrivals)))
        await asyncio.gather(*background)
    finally:
        done.set()
        await sampler
        makespan_s, cpu_s, busy_s = now(), time.process_time() - cpu0, backend.busy_s()
        await backend.stop()
    is_local = isinstance(backend, InprocBackend)
    return ReplayResult(load, records, steps, kv_samples, makespan_s, busy_s, cpu_s if is_local else None,
                        subagents=subagents)
