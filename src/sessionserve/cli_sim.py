"""`sessionserve calibrate | simulate | plan`: the simulator and capacity planner on the command line.

    sessionserve calibrate --model-size small --out bench/profiles/this-machine.json
    sessionserve simulate --trace weka_claude_code --profile bench/profiles/this-machine.json --policies discard,predictive
    sessionserve plan --trace weka_claude_code --users 10000 --slo-p99 2 --profile h100-llama3-8b

`simulate` takes the bench's workload flags and writes the bench's report
folder (report.md, results.json, plots), labelled as simulated.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from sessionserve.config import ADMISSION_MODES

MiB = 1 << 20
GiB = 1 << 30


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(kv_cache_bytes=args.device_kv_bytes, host_kv_bytes=args.host_kv_bytes,
                disk_kv_bytes=args.disk_kv_bytes, num_threads=args.threads, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, admission=args.admission,
                admission_fill=args.admission_fill, host_kv_int8=args.host_kv_int8)


# -- calibrate ------------------------------------------------------------------------------------

def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model folder (default: the embedded model)")
    parser.add_argument("--model-size", default="small", choices=("tiny", "small"), help="embedded model size")
    parser.add_argument("--device-kv-bytes", type=int, default=160 * MiB)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--grid", default="full", choices=("quick", "full"), help="batch shapes measured")
    parser.add_argument("--name", default=None, help="profile name (default: model@host)")
    parser.add_argument("--out", default=None, help="profile JSON (default: bench/profiles/<name>.json)")


def run_calibrate(args: argparse.Namespace) -> Path:
    from sessionserve.modelgen.make_model import ensure_model
    from sessionserve.planning.calibrate import Grid, calibrate

    model_dir = Path(args.model) if args.model else ensure_model("llama", args.model_size)
    kwargs = dict(kv_cache_bytes=args.device_kv_bytes, num_threads=args.threads, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    t0 = time.monotonic()
    profile = calibrate(model_dir, kwargs, Grid.quick() if args.grid == "quick" else Grid.full(), args.name)
    out = Path(args.out or Path("bench") / "profiles" / f"{profile.name.replace('/', '_')}.json")
    profile.save(out)
    s, fit = profile.step, profile.fit
    print(f"profile {profile.label}: {fit['num_steps']} steps measured in {time.monotonic() - t0:.0f} s; "
          f"fit error median {100 * fit['rel_error_median']:.1f}%, p90 {100 * fit['rel_error_p90']:.1f}%")
    print(f"  step = {s.overhead_s * 1e3:.3f} ms + {s.per_seq_s * 1e6:.1f} us/seq + {s.per_token_s * 1e6:.2f} "
          f"us/token + {s.per_attn_s * 1e9:.3f} ns/attention pair")
    print(f"  KV copy: host {profile.host_copy_bytes_per_s / 1e9:.2f} GB/s, disk "
          f"{profile.disk_copy_bytes_per_s / 1e9:.2f} GB/s, {profile.move_latency_s * 1e3:.2f} ms per move")
    print(f"wrote {out}")
    return out


# -- simulate -------------------------------------------------------------------------------------

def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    from sessionserve.cli_bench import add_bench_arguments

    add_bench_arguments(parser)
    parser.add_argument("--profile", required=True, help="profile JSON from `calibrate`, or a built-in name "
                        "(derived from specs): a100|h100|h200|gh200|l40s|mi300x-llama3-8b")
    parser.add_argument("--vs-real", action="store_true", help="also run the real engine (bench harness) on the "
                        "same workload and print sim-vs-real errors (fidelity)")


def run_simulate(args: argparse.Namespace) -> Path:
    from sessionserve.cli_bench import _loads, _machine, _print_summary
    from sessionserve.sim.profile import load_profile
    from sessionserve.planning.runs import run_sim
    from sessionserve.workload.loader import load_trace
    from sessionserve.workload.report import write_report
    from sessionserve.workload.results import build_results

    profile = load_profile(args.profile)
    trace = load_trace(args.trace, traces_dir=args.traces_dir, token_scale=args.token_scale,
                       time_scale=args.time_scale, max_sessions=args.num_sessions, max_steps=args.max_steps,
                       min_steps=args.min_steps if args.min_steps is not None else args.max_steps,
                       max_context_tokens=args.max_context, max_wait_s=args.max_wait_s, seed=args.seed,
                       wait_source=args.wait_source)
    if not trace.sessions:
        raise SystemExit(f"no sessions of {args.trace} pass the filters")
    loads = _loads(args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    kwargs = _engine_kwargs(args)
    t0 = time.monotonic()
    runs = run_sim(trace, policies, loads, profile, kwargs, seed=args.seed, hint_waits=args.hint_waits)
    wall_s = time.monotonic() - t0
    simulated_s = sum(r.makespan_s for rs in runs.values() for r in rs)
    steps = sum(r.extra["engine_steps"] for rs in runs.values() for r in rs)
    print(f"simulated {simulated_s:,.0f} s ({simulated_s / 3600:.2f} h) of serving, {steps:,} engine steps, in "
          f"{wall_s:.1f} s of wall time ({simulated_s / max(wall_s, 1e-9):,.0f}x real time)", file=sys.stderr)
    settings: dict[str, Any] = {"mode": args.mode, "loads": args.loads, "seed": args.seed,
                                "max_steps": args.max_steps, "max_context_tokens": args.max_context,
                                "max_wait_s": args.max_wait_s, **{k: v for k, v in kwargs.items() if v is not None},
                                "hint_waits": args.hint_waits, "profile": profile.label,
                                "sim_wall_s": round(wall_s, 2)}
    meta = {"command": shlex.join(["sessionserve", *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "model": f"{profile.model.name} (profile {profile.label})", "machine": _machine(),
            "backend": f"SIMULATED: the engine's scheduler and residency policies on a virtual clock, cost profile "
                       f"{profile.label}" + (" — derived from published specs, not measured" if
                                             profile.kind == "derived" else ""),
            "settings": settings}
    results = build_results(trace, runs, meta=meta, slo_jct_s=args.slo_jct_s, slo_factor=args.slo_factor)
    out = Path(args.out or Path("bench") / "out" / f"sim-{trace.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    report = write_report(out, results, runs)
    _print_summary(results)
    if args.vs_real:
        _vs_real(args, trace, policies, loads, kwargs, profile, runs, out)
    print(f"report: {report}")
    return report


def _vs_real(args: argparse.Namespace, trace: Any, policies: list[str], loads: list[Any], kwargs: dict[str, Any],
             profile: Any, sim_runs: Any, out: Path) -> None:
    """Real runs of the same workload; the simulation with `profile` and with step costs fitted online."""
    from sessionserve.modelgen.make_model import ensure_model
    from sessionserve.planning.fidelity import compare_runs, render_table, run_fidelity_online

    model_dir = Path(args.model) if args.model else ensure_model("llama", args.model_size)
    t0 = time.monotonic()
    real, _online_sim, online_rows, online = run_fidelity_online(trace, policies, loads, model_dir, kwargs, profile,
                                                                 seed=args.seed)
    rows = compare_runs(real, sim_runs)
    s = online.step
    text = (f"# Simulated vs real\n\nReal runs (bench harness, in-process) took {time.monotonic() - t0:.0f} s.\n\n"
            f"## Simulated with the profile {profile.label}\n\n{render_table(rows)}\n"
            f"## Simulated with step costs fitted on the real runs' own steps (online)\n\n"
            f"step = {s.overhead_s * 1e3:.3f} ms + {s.per_seq_s * 1e6:.1f} us/seq + {s.per_token_s * 1e6:.2f} us/token "
            f"+ {s.per_attn_s * 1e9:.3f} ns/pair; fit error median {100 * online.fit['rel_error_median']:.1f}%\n\n"
            f"{render_table(online_rows)}")
    (out / "fidelity.md").write_text(text)
    (out / "fidelity.json").write_text(json.dumps({"profile": rows, "online": online_rows,
                                                   "online_step": online.to_dict()["step"]}, indent=1) + "\n")
    print("\n" + text)


# -- plan -----------------------------------------------------------------------------------------

def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--trace", default="weka_claude_code", help="trace name or path (as for bench)")
    g.add_argument("--traces-dir", default=None)
    g.add_argument("--users", type=int, required=True, help="concurrent agents (closed loop) to serve")
    g.add_argument("--num-sessions", type=int, default=400, help="sessions of the trace to sample from")
    g.add_argument("--max-steps", type=int, default=50)
    g.add_argument("--min-steps", type=int, default=2)
    g.add_argument("--max-context", type=int, default=None, help="cut sessions before their context exceeds "
                   "this many tokens (default: 95%% of the model's context)")
    g.add_argument("--token-scale", type=float, default=1.0)
    g.add_argument("--time-scale", type=float, default=1.0)
    g.add_argument("--max-wait-s", type=float, default=600.0)
    g.add_argument("--sessions-per-user", type=float, default=1.5, help="sessions each simulated agent runs")
    g.add_argument("--seed", type=int, default=0)
    g = parser.add_argument_group("question")
    g.add_argument("--slo-p99", type=float, required=True, help="p99 LLM step latency SLO (s)")
    g.add_argument("--profile", required=True, help="profile JSON or built-in name")
    g.add_argument("--policies", default="discard,keep,least-waste,predictive")
    g.add_argument("--replicas", default=None, help="replica counts to try, comma-separated (default: a "
                   "geometric ladder around the estimate)")
    g.add_argument("--host-gib", default="0,256", help="host-tier GiB per replica to try, comma-separated")
    g.add_argument("--host-gib-cost", type=float, default=0.0, help="cost of 1 GiB of host tier per hour, in "
                   "replica-hours (default 0: host memory is part of the server)")
    g.add_argument("--device-kv-bytes", type=int, default=None, help="KV budget per replica (default: from the "
                   "profile's device memory)")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--admission", choices=ADMISSION_MODES, default="auto",
                   help="session admission by working set on the replicas (serve --admission)")
    g.add_argument("--max-sim-users", type=int, default=64, help="most agents per replica considered (the replica "
                   "ladder starts at users / this)")
    parser.add_argument("--jobs", type=int, default=None, help="worker processes for the independent (policy, "
                        "host tier) ladders (default: one per core)")
    parser.add_argument("--out", default=None, help="folder for plan.md, plan.json and the plots")


def run_plan(args: argparse.Namespace) -> Path:
    from sessionserve.planning.planner import PlanQuestion, plan, write_plan
    from sessionserve.sim.profile import load_profile
    from sessionserve.workload.loader import load_trace

    profile = load_profile(args.profile)
    # NOTE: sessions are cut before their context outgrows the model (as a client compacts); else they fail.
    max_context = args.max_context or int(0.95 * profile.model.max_model_len)
    trace = load_trace(args.trace, traces_dir=args.traces_dir, token_scale=args.token_scale,
                       time_scale=args.time_scale, max_sessions=args.num_sessions, max_steps=args.max_steps,
                       min_steps=args.min_steps, max_context_tokens=max_context, max_wait_s=args.max_wait_s,
                       seed=args.seed)
    question = PlanQuestion(
        users=args.users, slo_step_p99_s=args.slo_p99,
        policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
        host_gib=tuple(float(x) for x in args.host_gib.split(",")),
        replicas=None if args.replicas is None else tuple(int(x) for x in args.replicas.split(",")),
        device_kv_bytes=args.device_kv_bytes, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, admission=args.admission,
        sessions_per_user=args.sessions_per_user,
        host_gib_cost=args.host_gib_cost, max_sim_users=args.max_sim_users, seed=args.seed)
    t0 = time.monotonic()
    result = plan(trace, profile, question, jobs=args.jobs or os.cpu_count() or 1)
    out = Path(args.out or Path("bench") / "out" / f"plan-{trace.name}-{args.users}-{time.strftime('%Y%m%d-%H%M%S')}")
    meta = {"command": shlex.join(["sessionserve", *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "wall_s": round(time.monotonic() - t0, 1)}
    report = write_plan(out, result, meta)
    print(report.read_text())
    print(f"plan: {report}")
    return report


def main(argv: list[str] | None = None) -> None:
    """Standalone entry: `python -m sessionserve.cli_sim calibrate|simulate|plan ...`."""
    parser = argparse.ArgumentParser(prog="sessionserve", description=__doc__.splitlines()[0])
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    args.func(args)


def add_subcommands(sub: Any) -> None:
    """Register calibrate, simulate and plan on an argparse subparsers object."""
    p = sub.add_parser("calibrate", help="measure this machine and write a cost profile (JSON) for the simulator")
    add_calibrate_arguments(p)
    p.set_defaults(func=run_calibrate)
    p = sub.add_parser("simulate", help="replay an agent trace on the simulator (virtual clock); bench's report")
    add_simulate_arguments(p)
    p.set_defaults(func=run_simulate)
    p = sub.add_parser("plan", help="cheapest replicas x host tier x policy meeting a p99 step-latency SLO")
    add_plan_arguments(p)
    p.set_defaults(func=run_plan)


if __name__ == "__main__":
    main()
