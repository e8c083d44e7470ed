"""How fast the simulator runs: N concurrent agent sessions x S steps, spread over replicas.

Each replica is a `SimEngine` (the engine's own scheduler, session manager
and residency policy on a virtual clock) serving `--agents` concurrent
sessions, closed loop, as `sessionserve plan` probes one; replicas do not
interact (a session-affine router), so they are simulated one after another
in this process. Sessions are drawn from the trace among those with at least
`--steps` steps and cut to exactly `--steps`.

    .venv/bin/python bench/sim_speed.py --sessions 10000 --steps 50

Prints wall time, simulated time, LLM steps and engine steps, and the wall
time per engine step; `--profile-out FILE` writes a cProfile of the first
replica.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from sessionserve.config import Config
from sessionserve.planning.driver import SimReplay
from sessionserve.sim.engine import SimEngine
from sessionserve.planning.planner import FastPromptBuilder, replica_sessions
from sessionserve.sim.profile import load_profile
from sessionserve.workload.loader import load_trace
from sessionserve.workload.replay import LoadSpec

GiB = 1 << 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=10_000, help="concurrent sessions in all")
    p.add_argument("--steps", type=int, default=50, help="LLM steps per session")
    p.add_argument("--agents", type=int, default=25, help="concurrent sessions per replica")
    p.add_argument("--trace", default="weka_claude_code")
    p.add_argument("--traces-dir", default=None)
    p.add_argument("--token-scale", type=float, default=128.0)
    p.add_argument("--max-wait-s", type=float, default=600.0)
    p.add_argument("--profile", default="h100-llama3-8b")
    p.add_argument("--policy", default="predictive")
    p.add_argument("--device-kv-gib", type=float, default=52.0)
    p.add_argument("--host-kv-gib", type=float, default=256.0)
    p.add_argument("--replicas", type=int, default=None, help="simulate only this many replicas (a sample)")
    p.add_argument("--jobs", type=int, default=None, help="worker processes (default: one per core)")
    p.add_argument("--profile-out", default=None, help="cProfile of the first replica to this file")
    p.add_argument("--out", default=None, help="JSON summary to this file")
    args = p.parse_args()

    t_start = time.perf_counter()
    profile = load_profile(args.profile)
    trace = load_trace(args.trace, traces_dir=args.traces_dir, token_scale=args.token_scale,
                       max_steps=args.steps, min_steps=args.steps, max_wait_s=args.max_wait_s)
    if not trace.sessions:
        raise SystemExit(f"no session of {args.trace} has {args.steps} steps")
    num_replicas = math.ceil(args.sessions / args.agents)
    run_replicas = min(num_replicas, args.replicas or num_replicas)
    config = Config.from_kwargs(residency_policy=args.policy, kv_cache_bytes=int(args.device_kv_gib * GiB),
                                host_kv_bytes=int(args.host_kv_gib * GiB), disk_kv_bytes=0,
                                session_idle_ttl_s=1e9)
    jobs = [(r, min(args.agents, args.sessions - r * args.agents), r == 0 and args.profile_out)
            for r in range(run_replicas)]
    _WORK.update(trace=trace, config=config, profile=profile)
    t_load = time.perf_counter()
    workers = max(1, min(args.jobs or os.cpu_count() or 1, run_replicas))
    if workers == 1:
        results = [_run_replica(job) for job in jobs]
    else:
        # Replicas are independent: one process per core, forked after the trace is loaded (shared).
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            results = pool.map(_run_replica, jobs, chunksize=1)
    t_end = time.perf_counter()
    wall = t_end - t_load  # the simulation, all replicas and processes, from the loaded trace on
    simulated = sum(r["makespan_s"] for r in results)
    llm_steps = sum(r["llm_steps"] for r in results)
    engine_steps = sum(r["engine_steps"] for r in results)
    done = sum(r["sessions_done"] for r in results)
    cpu_s = sum(r["wall_s"] for r in results)
    scale = num_replicas / run_replicas
    summary = {
        "sessions": args.sessions, "steps_per_session": args.steps, "agents_per_replica": args.agents,
        "replicas": num_replicas, "replicas_run": run_replicas, "trace": args.trace, "profile": args.profile,
        "policy": args.policy, "processes": workers, "load_s": round(t_load - t_start, 2),
        "wall_s": round(wall, 2), "wall_s_all_replicas": round(wall * scale, 2),
        "replica_s_sum": round(cpu_s, 2),
        "simulated_replica_hours": round(simulated / 3600, 2), "llm_steps": llm_steps,
        "engine_steps": engine_steps, "sessions_done": done,
        "us_per_engine_step": round(1e6 * cpu_s / max(engine_steps, 1), 1),
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")


_WORK: dict = {}  # what every replica shares, set before the worker processes fork


def _run_replica(job: tuple[int, int, str | bool]) -> dict:
    r, agents, profile_out = job
    trace, config, profile = _WORK["trace"], _WORK["config"], _WORK["profile"]
    engine = SimEngine(config, profile)
    rep = SimReplay(engine, replica_sessions(trace, agents, seed=r), LoadSpec("closed", agents), seed=r)
    rep.builder = FastPromptBuilder(profile.model.vocab_size, r)
    prof = cProfile.Profile() if profile_out else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    result = rep.run()
    if prof is not None:
        prof.disable()
        prof.dump_stats(str(profile_out))
    return {"wall_s": time.perf_counter() - t0, "makespan_s": result.makespan_s, "llm_steps": len(result.steps),
            "engine_steps": engine.core.num_steps,
            "sessions_done": sum(1 for s in result.sessions if s.end_s is not None)}


if __name__ == "__main__":
    main()
