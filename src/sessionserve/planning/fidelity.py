"""Sim vs real: the same trace, policies and loads on the real engine (bench harness) and the simulator.

`compare_runs` puts the headline figures side by side with the relative error
of the simulation; `run_fidelity` runs both sides. The real side is
`workload.sweep.run_inproc`, exactly what `sessionserve bench` runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sessionserve.sim.profile import CostProfile
from sessionserve.workload.metrics import summarize
from sessionserve.workload.replay import LoadSpec
from sessionserve.workload.sweep import Runs
from sessionserve.workload.trace import TraceSet

FIDELITY_KEYS = ("jct_p50_s", "jct_p99_s", "sessions_per_hour", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
                 "makespan_s")


def compare_runs(real: Runs, sim: Runs, keys: Sequence[str] = FIDELITY_KEYS) -> list[dict[str, Any]]:
    """One row per (policy, load, figure): real value, simulated value, relative error (sim / real - 1)."""
    rows: list[dict[str, Any]] = []
    for policy, real_results in real.items():
        for r, s in zip(real_results, sim[policy]):
            rs, ss = summarize(r), summarize(s)
            for key in keys:
                a, b = rs.get(key), ss.get(key)
                err = None if a in (None, 0) or b is None else b / a - 1
                rows.append({"policy": policy, "load": rs["load"], "figure": key, "real": a, "sim": b,
                             "rel_error": err})
    return rows


def max_abs_error(rows: Sequence[dict[str, Any]], figures: Sequence[str]) -> float:
    errs = [abs(r["rel_error"]) for r in rows if r["figure"] in figures and r["rel_error"] is not None]
    return max(errs) if errs else float("nan")


def run_fidelity(trace: TraceSet, policies: Sequence[str], loads: Sequence[LoadSpec], model_dir: str | Path,
                 engine_kwargs: dict[str, Any], profile: CostProfile, *, seed: int = 0, warm: bool = True
                 ) -> tuple[Runs, Runs, list[dict[str, Any]]]:
    """Real runs, simulated runs and their comparison, for the same engine settings."""
    from sessionserve.planning.runs import run_sim
    from sessionserve.workload.sweep import run_inproc, warm_up

    if warm:
        warm_up(model_dir, {**engine_kwargs, "residency_policy": policies[0]}, seed)
    real = run_inproc(trace, policies, loads, model_dir, engine_kwargs, seed=seed)
    sim = run_sim(trace, policies, loads, profile, engine_kwargs, seed=seed)
    return real, sim, compare_runs(real, sim)


def render_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| policy | load | figure | real | sim | sim/real - 1 |", "|---|---|---|---|---|---|"]
    for r in rows:
        def f(v: Any) -> str:
            return "–" if v is None else f"{v:,.3f}"
        err = "–" if r["rel_error"] is None else f"{100 * r['rel_error']:+.1f}%"
        lines.append(f"| {r['policy']} | {r['load']} | {r['figure']} | {f(r['real'])} | {f(r['sim'])} | {err} |")
    return "\n".join(lines) + "\n"


def run_real_recorded(trace: TraceSet, policies: Sequence[str], loads: Sequence[LoadSpec], model_dir: str | Path,
                      engine_kwargs: dict[str, Any], *, seed: int = 0) -> tuple[Runs, Any]:
    """`run_inproc`, with a `StepRecorder` on every engine: the real runs and their step samples."""
    import asyncio

    from sessionserve.config import Config
    from sessionserve.llm_engine import LLMEngine
    from sessionserve.planning.calibrate import StepRecorder
    from sessionserve.workload.replay import InprocBackend, replay

    recorder = StepRecorder()
    runs: Runs = {p: [] for p in policies}
    for load in loads:
        for policy in policies:
            eng = LLMEngine(Config.from_kwargs(residency_policy=policy, **engine_kwargs), model_dir)
            recorder.attach(eng)
            try:
                runs[policy].append(asyncio.run(replay(InprocBackend(eng), trace.sessions, load, seed=seed)))
            finally:
                eng.close()
    return runs, recorder


def run_fidelity_online(trace: TraceSet, policies: Sequence[str], loads: Sequence[LoadSpec],
                        model_dir: str | Path, engine_kwargs: dict[str, Any], base: CostProfile, *, seed: int = 0
                        ) -> tuple[Runs, Runs, list[dict[str, Any]], CostProfile]:
    """Real runs first, step costs fitted on their own steps (same machine load), then the simulation.

    On a shared machine whose speed drifts minute to minute, this separates the simulator's error (batching,
    queueing, waits, policies) from the drift between a calibration and a later run. `base` gives the model
    shape and copy bandwidths.
    """
    from sessionserve.planning.calibrate import fit_step_cost
    from sessionserve.planning.runs import run_sim
    from sessionserve.workload.sweep import warm_up

    warm_up(model_dir, {**engine_kwargs, "residency_policy": policies[0]}, seed)
    real, recorder = run_real_recorded(trace, policies, loads, model_dir, engine_kwargs, seed=seed)
    cost, fit = fit_step_cost(recorder.shapes, recorder.seconds)  # step-to-step times: the loop's hop included
    profile = base.with_(step=cost, fit={**fit, "method": "online: fitted on the compared runs' steps"},
                         name=f"{base.name} (online)")
    sim = run_sim(trace, policies, loads, profile, engine_kwargs, seed=seed)
    return real, sim, compare_runs(real, sim), profile
