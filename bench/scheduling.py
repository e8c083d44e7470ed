"""Interactive and background agents on one engine: FCFS vs session-aware scheduling, side by side.

Replays real Claude Code sessions (../shared/traces/weka_claude_code) with a
fixed fraction of them (chosen by the seed) declared `batch` and the rest
`interactive`, through the in-process engine on the embedded `small` model,
once per scheduling policy on a fresh engine, alternating policies and
repeating. Reports, per policy: interactive step latency and time to first
token (p50/p99), background output tokens per second, and ratios to FCFS.

    .venv/bin/python bench/scheduling.py                       # defaults recorded in bench/RESULTS.md
    .venv/bin/python bench/scheduling.py --repeats 1 --sessions 16

With `--simulate PROFILE` the same comparison runs on the simulator (the
engine's own scheduler and residency policy on a virtual clock, step times
from PROFILE: a `sessionserve calibrate` JSON or a built-in name), and
`--replicas R` makes it a fleet: R independent replicas (a session-affine
router: replicas do not interact), each with `--concurrency` agents and
`--sessions` sessions of its own, drawn from the trace with a per-replica
seed; percentiles are over every replica's steps.

    .venv/bin/python bench/scheduling.py --simulate bench/profiles/small.json --replicas 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sessionserve.config import Config
from sessionserve.llm_engine import LLMEngine
from sessionserve.modelgen.make_model import ensure_model
from sessionserve.workload.inproc import InprocBackend
from sessionserve.workload.loader import load_trace
from sessionserve.workload.metrics import percentile
from sessionserve.workload.replay import LoadSpec, ReplayResult, pool_results, replay
from sessionserve.workload.sweep import record_engine_checks, warm_up
from sessionserve.workload.trace import with_batch_fraction


def class_metrics(result: ReplayResult) -> dict[str, Any]:
    """Per scheduling class: step latency / TTFT percentiles, output tokens per second of the run."""
    klass = {r.session_id: r.priority for r in result.sessions}
    out: dict[str, Any] = {"makespan_s": result.makespan_s,
                           "failed_sessions": sum(1 for r in result.sessions if r.error)}
    for name in ("interactive", "batch"):
        steps = [s for s in result.steps if klass.get(s.session_id) == name]
        lat = [s.result.latency_s for s in steps]
        ttft = [s.result.ttft_s for s in steps if s.result.ttft_s is not None]
        tokens = sum(len(s.result.output_token_ids) for s in steps)
        done = [r for r in result.sessions if r.priority == name and r.end_s is not None]
        out[name] = {"steps": len(steps), "sessions_done": len(done),
                     "step_p50_s": percentile(lat, 0.5), "step_p99_s": percentile(lat, 0.99),
                     "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
                     "output_tok_per_s": tokens / result.makespan_s if result.makespan_s else None,
                     "last_done_s": max((r.end_s for r in done), default=None)}
    return out


def simulate_fleet(policy: str, trace: Any, profile: Any, engine_kwargs: dict[str, Any], a: argparse.Namespace
                   ) -> dict[str, Any]:
    """The comparison on the simulator: `a.replicas` replicas, one after another, pooled."""
    from sessionserve.planning.driver import simulate
    from sessionserve.sim.engine import SimEngine
    from sessionserve.planning.planner import replica_sessions

    results, preemptions = [], 0
    for r in range(a.replicas):
        picks = trace.sessions if a.replicas == 1 else replica_sessions(trace, a.sessions, a.seed + r)
        sessions = with_batch_fraction(tuple(picks), a.batch_fraction, a.seed + r)
        eng = SimEngine(Config.from_kwargs(scheduling_policy=policy, **engine_kwargs), profile)
        results.append(simulate(eng, sessions, LoadSpec("closed", a.concurrency), seed=a.seed + r))
        preemptions += eng.core.scheduler.num_priority_preemptions
    metrics = class_metrics(pool_results(results))
    metrics["priority_preemptions"] = preemptions
    return metrics


def run_once(policy: str, sessions: Any, model_dir: Path, engine_kwargs: dict[str, Any], concurrency: int,
             seed: int) -> dict[str, Any]:
    eng = LLMEngine(Config.from_kwargs(scheduling_policy=policy, **engine_kwargs), model_dir)
    try:
        result = record_engine_checks(eng, asyncio.run(replay(InprocBackend(eng), sessions,
                                                              LoadSpec("closed", concurrency), seed=seed)))
        metrics = class_metrics(result)
        metrics.update(result.extra)
        metrics["priority_preemptions"] = eng.core.scheduler.num_priority_preemptions
        return metrics
    finally:
        eng.close()


def _med(runs: list[dict[str, Any]], klass: str, key: str) -> tuple[float | None, float | None]:
    vals = [r[klass][key] for r in runs if r[klass][key] is not None]
    return (min(vals), statistics.median(vals)) if vals else (None, None)


def markdown(results: dict[str, list[dict[str, Any]]], settings: dict[str, Any]) -> str:
    lines = ["| policy | interactive step p50 s | interactive step p99 s (min / median) | interactive TTFT p99 s "
             "| batch output tok/s (min / median) | batch sessions done | priority preemptions |",
             "|---|---|---|---|---|---|---|"]
    base = results.get("fcfs")
    for policy, runs in results.items():
        p50 = _med(runs, "interactive", "step_p50_s")[1]
        p99 = _med(runs, "interactive", "step_p99_s")
        ttft = _med(runs, "interactive", "ttft_p99_s")[1]
        btp = _med(runs, "batch", "output_tok_per_s")
        done = statistics.median(r["batch"]["sessions_done"] for r in runs)
        pre = statistics.median(r["priority_preemptions"] for r in runs)
        lines.append(f"| {policy} | {p50:.2f} | {p99[0]:.2f} / **{p99[1]:.2f}** | {ttft:.2f} | "
                     f"{btp[0]:.1f} / **{btp[1]:.1f}** | {done:g} | {pre:g} |")
    if base is not None and "priority" in results:
        b99, o99 = _med(base, "interactive", "step_p99_s")[1], _med(results["priority"], "interactive", "step_p99_s")[1]
        btp_b, btp_o = _med(base, "batch", "output_tok_per_s")[1], _med(results["priority"], "batch", "output_tok_per_s")[1]
        lines.append("")
        lines.append(f"Interactive p99 step latency, FCFS / priority: **{b99 / o99:.2f}x** lower with priority; "
                     f"background throughput, priority / FCFS: **{btp_o / btp_b:.2f}x** (medians).")
    lines.append("")
    lines.append("Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="weka_claude_code")
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--batch-fraction", type=float, default=0.5)
    p.add_argument("--token-scale", type=float, default=128.0)
    p.add_argument("--time-scale", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--policies", default="fcfs,priority")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model-size", default="small", choices=("tiny", "small"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device-kv-bytes", type=int, default=96 << 20)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--host-prefix-cache-bytes", type=int, default=0,
                   help="host memory for blocks the device's prefix cache evicts (0: none)")
    p.add_argument("--background-prefill-tokens", type=int, default=None,
                   help="priority policy: background prefill per step while interactive turns run "
                        "(default: the engine's)")
    p.add_argument("--las-quantum-tokens", type=int, default=None,
                   help="priority policy: service per level (default: the engine's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--simulate", metavar="PROFILE", default=None,
                   help="run on the simulator with this cost profile (calibrate JSON or built-in name)")
    p.add_argument("--replicas", type=int, default=1, help="with --simulate: independent replicas (a fleet)")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "scheduling"))
    a = p.parse_args()
    if a.simulate is None and a.replicas != 1:
        p.error("--replicas needs --simulate")

    # A fleet draws each replica's sessions from the whole trace; one engine replays its first `sessions`.
    trace = load_trace(a.trace, token_scale=a.token_scale, time_scale=a.time_scale,
                       max_sessions=a.sessions if a.replicas == 1 else None, max_steps=a.max_steps, seed=a.seed)
    sessions = with_batch_fraction(trace.sessions, a.batch_fraction, a.seed)
    engine_kwargs = dict(kv_cache_bytes=a.device_kv_bytes, host_kv_bytes=2 << 30, num_threads=a.threads,
                         max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                         residency_policy="predictive", session_idle_ttl_s=1e9)  # no expiry mid-wait
    if a.las_quantum_tokens is not None:
        engine_kwargs["las_quantum_tokens"] = a.las_quantum_tokens
    if a.background_prefill_tokens is not None:
        engine_kwargs["background_prefill_tokens"] = a.background_prefill_tokens
    if a.host_prefix_cache_bytes:
        engine_kwargs["host_prefix_cache_bytes"] = a.host_prefix_cache_bytes
    profile = None
    if a.simulate is not None:
        from sessionserve.sim.profile import load_profile

        profile = load_profile(a.simulate)
    else:
        model_dir = ensure_model("llama", a.model_size)
        warm_up(model_dir, engine_kwargs, a.seed)
    policies = [x.strip() for x in a.policies.split(",") if x.strip()]
    results: dict[str, list[dict[str, Any]]] = {pol: [] for pol in policies}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for rep in range(a.repeats):
        order = policies if rep % 2 == 0 else list(reversed(policies))  # alternate: neither always runs first
        for policy in order:
            t0 = time.monotonic()
            if profile is not None:
                results[policy].append(simulate_fleet(policy, trace, profile, engine_kwargs, a))
            else:
                results[policy].append(run_once(policy, sessions, model_dir, engine_kwargs, a.concurrency, a.seed))
            r = results[policy][-1]
            print(f"[scheduling] repeat {rep + 1} {policy}: {time.monotonic() - t0:.0f} s, interactive p99 "
                  f"{r['interactive']['step_p99_s']:.2f} s, batch {r['batch']['output_tok_per_s']:.1f} tok/s",
                  flush=True)
    settings = {"trace": a.trace, "sessions": len(sessions), "batch_fraction": a.batch_fraction,
                "tokens/": a.token_scale, "waits/": a.time_scale, "agents": a.concurrency,
                "model": a.model_size, "threads": a.threads, "device_kv_MiB": a.device_kv_bytes >> 20,
                "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens,
                "las_quantum_tokens": a.las_quantum_tokens or "default",
                "background_prefill_tokens": "default" if a.background_prefill_tokens is None
                else a.background_prefill_tokens,
                "host_prefix_cache_MiB": a.host_prefix_cache_bytes >> 20,
                "repeats": a.repeats, "seed": a.seed, "started": started, "machine": platform.processor() or
                platform.machine()}
    if profile is not None:
        settings.update(simulated=f"profile {profile.label}", replicas=a.replicas,
                        sessions=a.sessions * a.replicas, agents=a.concurrency * a.replicas)
    md = markdown(results, settings)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scheduling.json").write_text(json.dumps({"settings": settings, "results": results}, indent=1))
    (out / "scheduling.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
