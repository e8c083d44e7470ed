"""Runs of a trace: every policy at every load, side by side in one process (in-process), or one server (HTTP).

In-process, each (policy, load) run gets a fresh `LLMEngine` with the same
config but the residency policy, so no run inherits another's cache. A short
warm-up run first builds kernels and caches, so the first policy does not
pay for them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sessionserve.config import SessionConfig
from sessionserve.workload.backend import Backend
from sessionserve.workload.progress import Progress
from sessionserve.workload.replay import InprocBackend, LoadSpec, ReplayResult, SessionRecord, replay
from sessionserve.workload.trace import AgentSession, Step, TraceSet

Runs = dict[str, list[ReplayResult]]  # series (policy or server label) -> one result per load, in load order


def progress_tick(progress: Progress | None) -> Callable[[SessionRecord], None] | None:
    """A per-session callback that advances `progress` (None without one)."""
    return None if progress is None else (lambda _rec: progress.advance())


def sweep_policies(policies: Sequence[str], loads: Sequence[LoadSpec],
                   run_one: Callable[[str, LoadSpec], ReplayResult], progress: Progress | None = None) -> Runs:
    """`run_one(policy, load)` for every load and policy, loads outer; results grouped by policy."""
    runs: Runs = {p: [] for p in policies}
    for load in loads:
        for policy in policies:
            if progress is not None:
                progress.set_label(f"{policy} @ {load.label}")
            runs[policy].append(run_one(policy, load))
    return runs


def record_engine_checks(eng: Any, result: ReplayResult) -> ReplayResult:
    """After a run on `eng` (real or simulated): check the KV pool and note leaked blocks and preemptions."""
    eng.kv.check_integrity()
    result.extra["leaked_blocks"] = eng.kv.pool.num_used_blocks
    result.extra["preemptions"] = eng.core.scheduler.num_preemptions
    return result


def with_replay_ttl(trace: TraceSet, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """`engine_kwargs` with an idle TTL the trace's agents outlast no wait of: a replayed agent always comes
    back, so a session closed while it waits would only turn that wait into a failed session. An explicit
    `session_idle_ttl_s` is kept (a run may mean to measure expiry)."""
    if engine_kwargs.get("session_idle_ttl_s") is not None:
        return engine_kwargs
    longest = max((s.expected_wait_s(k) for s in trace.sessions for k in range(len(s.steps))), default=0.0)
    return {**engine_kwargs, "session_idle_ttl_s": max(SessionConfig.session_idle_ttl_s, 2 * longest + 60.0)}


def warm_up(model_dir: str | Path, engine_kwargs: dict[str, Any], seed: int = 0) -> None:
    """One 2-step session on a throwaway engine: builds the attention kernel and warms caches."""
    from sessionserve.config import Config
    from sessionserve.llm_engine import LLMEngine

    eng = LLMEngine(Config.from_kwargs(**engine_kwargs), model_dir)
    session = AgentSession("warmup", (Step(64, 4, (), "tool"), Step(16, 4, (), "end")))
    try:
        asyncio.run(replay(InprocBackend(eng), [session], LoadSpec("closed", 1), seed=seed))
    finally:
        eng.close()


def run_inproc(trace: TraceSet, policies: Sequence[str], loads: Sequence[LoadSpec], model_dir: str | Path,
               engine_kwargs: dict[str, Any], *, seed: int = 0, hint_waits: bool = False,
               progress: Progress | None = None) -> Runs:
    """Replay `trace` once per (policy, load) on fresh engines; `engine_kwargs` go to `Config.from_kwargs`."""
    from sessionserve.config import Config
    from sessionserve.llm_engine import LLMEngine

    engine_kwargs = with_replay_ttl(trace, engine_kwargs)

    def run_one(policy: str, load: LoadSpec) -> ReplayResult:
        eng = LLMEngine(Config.from_kwargs(residency_policy=policy, **engine_kwargs), model_dir)
        try:
            return record_engine_checks(eng, asyncio.run(replay(
                InprocBackend(eng, hint_waits), trace.sessions, load, seed=seed,
                on_session_done=progress_tick(progress))))
        finally:
            eng.close()

    return sweep_policies(policies, loads, run_one, progress)


def run_http(trace: TraceSet, label: str, loads: Sequence[LoadSpec], make_backend: Callable[[], Backend], *,
             seed: int = 0, progress: Progress | None = None) -> Runs:
    """Replay `trace` once per load against a server; `make_backend` gives a fresh backend per run."""
    runs: Runs = {label: []}
    for load in loads:
        if progress is not None:
            progress.set_label(f"{label} @ {load.label}")
        backend = make_backend()
        result = asyncio.run(replay(backend, trace.sessions, load, seed=seed, on_session_done=progress_tick(progress)))
        stand_ins = getattr(backend, "num_stand_in_steps", None)
        if stand_ins is not None:
            result.extra["stand_in_output_steps"] = stand_ins
        runs[label].append(result)
    return runs
