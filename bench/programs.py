"""Multi-call programs under open-loop load: FCFS vs program-order scheduling, programs/hour at equal p99.

Each program is a real Claude Code session of ../shared/traces/weka_claude_code
(its LLM steps and tool waits, tokens / 128, waits / 10 capped at 30 s),
arriving as a Poisson process at each `--rates` value (programs per second),
through the in-process engine on the embedded `small` model. Per scheduling
policy and rate: programs/hour, program completion time (JCT) p50/p99, step
latency, scheduler preemptions, and the time turns waited for their KV.

The comparison is the one a provider makes: at a latency promise (p99 JCT at
most `--slo-jct-s`; default `--slo-factors` x FCFS's own p99 at the lightest
rate run: 1.05 is "equal p99", within 5%; 2 is "at most twice as slow as
unloaded"), how many programs per hour can each policy take? A rate that
misses the promise counts for nothing. Sessions are cut before their context
passes 95% of the model's or of the device KV (as a client compacts;
otherwise they fail alike under every policy).

    .venv/bin/python bench/programs.py --runs fcfs@0.03,fcfs@0.1,priority@0.03,priority@0.1

With `--simulate PROFILE` the same runs go through the simulator (the engine's
own scheduler and residency policy on a virtual clock), and `--replicas R`
makes a fleet of R independent replicas, each with `--sessions` programs of
its own drawn from the whole trace (R x the scale), pooled:

    .venv/bin/python bench/programs.py --simulate bench/profiles/llama-small-2core.json --replicas 100 \\
        --runs fcfs@0.03,fcfs@0.06,fcfs@0.1,priority@0.03,priority@0.06,priority@0.1,priority@0.15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sessionserve.config import Config
from sessionserve.workload.loader import load_trace
from sessionserve.workload.metrics import LoadPoint, goodput_at_slo, percentile, summarize
from sessionserve.workload.replay import LoadSpec, ReplayResult, pool_results


def metrics(result: ReplayResult, preemptions: int) -> dict[str, Any]:
    s = summarize(result)
    jct = [r.jct_s for r in result.sessions if r.jct_s is not None]
    lat = [x.result.latency_s for x in result.steps]
    return {"programs_per_hour": s["sessions_per_hour"], "programs_done": len(jct),
            "failed": sum(1 for r in result.sessions if r.end_s is None),
            "jct_p50_s": percentile(jct, 0.5), "jct_p99_s": percentile(jct, 0.99),
            "step_p50_s": percentile(lat, 0.5), "step_p99_s": percentile(lat, 0.99),
            "ttft_p99_s": s.get("ttft_p99_s"), "preemptions": preemptions,
            "restore_blocked_s": s.get("restore_blocked_s"), "recompute_tokens": s.get("recompute_tokens"),
            "makespan_s": result.makespan_s}


def run_real(policy: str, rate: float, sessions: Any, engine_kwargs: dict[str, Any], model_dir: Path,
             seed: int) -> dict[str, Any]:
    from sessionserve.llm_engine import LLMEngine
    from sessionserve.workload.inproc import InprocBackend
    from sessionserve.workload.replay import replay
    from sessionserve.workload.sweep import record_engine_checks

    eng = LLMEngine(Config.from_kwargs(scheduling_policy=policy, **engine_kwargs), model_dir)
    try:
        result = record_engine_checks(eng, asyncio.run(replay(InprocBackend(eng), sessions,
                                                              LoadSpec("open", rate_per_s=rate), seed=seed)))
        out = metrics(result, eng.core.scheduler.num_preemptions)
        out["leaked_blocks"] = result.extra["leaked_blocks"]
        return out
    finally:
        eng.close()


def run_sim(policy: str, rate: float, trace: Any, engine_kwargs: dict[str, Any], profile: Any,
            a: argparse.Namespace) -> dict[str, Any]:
    """R independent replicas, one after another, pooled (the fleet's makespan is the longest)."""
    from sessionserve.planning.driver import simulate
    from sessionserve.sim.engine import SimEngine
    from sessionserve.planning.planner import replica_sessions

    results, preemptions = [], 0
    for r in range(a.replicas):
        picks = trace.sessions if a.replicas == 1 else replica_sessions(trace, a.sessions, a.seed + r)
        eng = SimEngine(Config.from_kwargs(scheduling_policy=policy, **engine_kwargs), profile)
        results.append(simulate(eng, picks, LoadSpec("open", rate_per_s=rate), seed=a.seed + r))
        preemptions += eng.core.scheduler.num_preemptions
    return metrics(pool_results(results), preemptions)


def markdown(rows: list[dict[str, Any]], slos: list[float], settings: dict[str, Any]) -> str:
    def f(v: Any, d: int = 1) -> str:
        return "-" if v is None else f"{v:.{d}f}"

    lines = ["| policy | rate /s | programs/h | JCT p50 s | JCT p99 s | step p50 s | step p99 s | preemptions "
             "| restore-blocked s | failed |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['rate']:g} | {f(r['programs_per_hour'])} | {f(r['jct_p50_s'])} | "
                     f"**{f(r['jct_p99_s'])}** | {f(r['step_p50_s'], 2)} | {f(r['step_p99_s'], 2)} | "
                     f"{r['preemptions']} | {f(r['restore_blocked_s'])} | {r['failed']} |")
    lines.append("")
    for slo_s in slos:
        good = {}
        for policy in dict.fromkeys(r["policy"] for r in rows):
            points = [LoadPoint(r["rate"], r["programs_per_hour"], r["jct_p99_s"], r["failed"])
                      for r in rows if r["policy"] == policy]
            good[policy] = goodput_at_slo(points, slo_s)
        lines.append(f"Programs/hour at p99 JCT <= {slo_s:.1f} s: " +
                     ", ".join(f"{p} **{v:.1f}**" for p, v in good.items()))
        if good.get("fcfs"):
            lines.append("Ratio to FCFS: " + ", ".join(f"{p} **{v / good['fcfs']:.2f}x**"
                                                       for p, v in good.items() if p != "fcfs"))
    lines.append("")
    lines.append("Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="weka_claude_code")
    p.add_argument("--sessions", type=int, default=40, help="programs per run (per replica with --replicas)")
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--token-scale", type=float, default=128.0)
    p.add_argument("--time-scale", type=float, default=10.0)
    p.add_argument("--max-wait-s", type=float, default=30.0)
    p.add_argument("--runs", default="fcfs@0.03,fcfs@0.1,priority@0.03,priority@0.1",
                   help="policy@rate (programs/s) pairs, run in this order")
    p.add_argument("--slo-jct-s", type=float, default=None, help="p99 JCT promise, in seconds")
    p.add_argument("--slo-factors", default="1.05,2", help="without --slo-jct-s: promises as multiples of "
                   "FCFS's p99 JCT at the lightest rate run")
    p.add_argument("--max-context", type=int, default=None, help="cut sessions before their context passes "
                   "this many tokens (default: 95%% of the model's context or of the device KV, if less)")
    p.add_argument("--model-size", default="small", choices=("tiny", "small"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device-kv-bytes", type=int, default=96 << 20)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--simulate", metavar="PROFILE", default=None)
    p.add_argument("--replicas", type=int, default=1, help="with --simulate: independent replicas (a fleet)")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "programs"))
    a = p.parse_args()
    if a.simulate is None and a.replicas != 1:
        p.error("--replicas needs --simulate")
    runs = []
    for item in a.runs.split(","):
        policy, _, rate = item.strip().partition("@")
        runs.append((policy, float(rate)))

    if a.max_context is None:
        from sessionserve.modelgen.make_model import model_config

        cfg = model_config("llama", a.model_size, 0, 0)
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        kv_tokens = a.device_kv_bytes // (2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4)
        a.max_context = int(0.95 * min(cfg["max_position_embeddings"], kv_tokens))  # float32 KV
    trace = load_trace(a.trace, token_scale=a.token_scale, time_scale=a.time_scale, max_wait_s=a.max_wait_s,
                       max_sessions=a.sessions if a.replicas == 1 else None, max_steps=a.max_steps,
                       max_context_tokens=a.max_context, seed=a.seed)
    engine_kwargs = dict(kv_cache_bytes=a.device_kv_bytes, host_kv_bytes=2 << 30, num_threads=a.threads,
                         max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                         residency_policy="predictive", session_idle_ttl_s=1e9)
    profile = model_dir = None
    if a.simulate is not None:
        from sessionserve.sim.profile import load_profile

        profile = load_profile(a.simulate)
    else:
        from sessionserve.modelgen.make_model import ensure_model
        from sessionserve.workload.sweep import warm_up

        model_dir = ensure_model("llama", a.model_size)
        warm_up(model_dir, engine_kwargs, a.seed)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []
    for policy, rate in runs:
        t0 = time.monotonic()
        if profile is not None:
            r = run_sim(policy, rate, trace, engine_kwargs, profile, a)
        else:
            r = run_real(policy, rate, trace.sessions, engine_kwargs, model_dir, a.seed)
        rows.append({"policy": policy, "rate": rate, **r})
        print(f"[programs] {policy} @ {rate:g}/s: {time.monotonic() - t0:.0f} s, {r['programs_per_hour']:.1f} "
              f"programs/h, JCT p99 {r['jct_p99_s']:.1f} s, {r['preemptions']} preemptions", flush=True)
    slos = [a.slo_jct_s] if a.slo_jct_s is not None else []
    fcfs = [r for r in rows if r["policy"] == "fcfs" and r["jct_p99_s"] is not None]
    if not slos and fcfs:
        base = min(fcfs, key=lambda r: r["rate"])["jct_p99_s"]
        slos = [float(f) * base for f in a.slo_factors.split(",")]
    settings = {"trace": a.trace, "programs": a.sessions * a.replicas, "max_steps": a.max_steps,
                "tokens/": a.token_scale, "waits/": a.time_scale, "max_wait_s": a.max_wait_s,
                "model": a.model_size, "threads": a.threads, "device_kv_MiB": a.device_kv_bytes >> 20,
                "max_context": a.max_context, "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens,
                "residency": "predictive", "seed": a.seed, "started": started,
                "machine": platform.processor() or platform.machine()}
    if profile is not None:
        settings.update(simulated=f"profile {profile.label}", replicas=a.replicas)
    md = markdown(rows, slos, settings)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "programs.json").write_text(json.dumps({"settings": settings, "slo_jct_s": slos, "rows": rows}, indent=1))
    (out / "programs.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
