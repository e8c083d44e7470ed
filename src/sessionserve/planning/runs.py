"""Simulated runs of a trace: every policy at every load on a fresh `SimEngine`, as `workload.sweep.run_inproc`.

Returns the same `Runs` mapping, so `workload.results.build_results` and
`workload.report.write_report` make the same report.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sessionserve.config import Config
from sessionserve.planning.driver import simulate
from sessionserve.sim.engine import SimEngine
from sessionserve.sim.profile import CostProfile
from sessionserve.workload.progress import Progress
from sessionserve.workload.replay import LoadSpec, ReplayResult
from sessionserve.workload.sweep import Runs, progress_tick, record_engine_checks, sweep_policies, with_replay_ttl
from sessionserve.workload.trace import TraceSet

# Options of the real engine that mean nothing to the simulator (the profile describes the model).
MODEL_ONLY_OPTIONS = ("model", "dtype", "device", "num_threads", "seed", "pack_weights")


def sim_config(policy: str, engine_kwargs: dict[str, Any]) -> Config:
    kwargs = {k: v for k, v in engine_kwargs.items() if k not in MODEL_ONLY_OPTIONS}
    return Config.from_kwargs(residency_policy=policy, **kwargs)


def run_sim(trace: TraceSet, policies: Sequence[str], loads: Sequence[LoadSpec], profile: CostProfile,
            engine_kwargs: dict[str, Any], *, seed: int = 0, hint_waits: bool = False,
            progress: Progress | None = None) -> Runs:
    """Simulate `trace` once per (policy, load); `engine_kwargs` as for `run_inproc`."""
    engine_kwargs = with_replay_ttl(trace, engine_kwargs)

    def run_one(policy: str, load: LoadSpec) -> ReplayResult:
        eng = SimEngine(sim_config(policy, engine_kwargs), profile)
        result = record_engine_checks(eng, simulate(eng, trace.sessions, load, seed=seed, hint_waits=hint_waits,
                                                    on_session_done=progress_tick(progress)))
        result.extra["engine_steps"] = eng.core.num_steps
        return result

    return sweep_policies(policies, loads, run_one, progress)
