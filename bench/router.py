"""Scale-out routing: our session/KV-aware router vs the routers a practitioner would deploy, one run.

The baselines (`--baselines`): Ray Serve's default (`pow2`, power of two
choices on requests in flight), a sticky-session balancer (`sticky`,
consistent hashing on the session id) and a prefix-aware router (`prefix`,
the longest cached prefix, ties to the least loaded, as vLLM's production
stack routes) and a prefix-and-load router (`prefix-load`: blocks to prefill
weighed against requests in flight, as llm-d scores). Starts a local Ray cluster and, one router at a
time, a Serve app of an ingress and N engine replicas of the same model and
settings behind that router; replays the same agent trace over HTTP
(`sessionserve bench --backend http`'s driver: streamed /v1/completions with
X-Session-ID, full prompt every step) against it, and writes a report with
every series (ratios to Ray's default) plus ours vs each baseline.

    .venv/bin/python bench/router.py                                  # defaults recorded in bench/RESULTS.md
    .venv/bin/python bench/router.py --replicas 2 --loads 8 --num-sessions 16

With `--simulate PROFILE` the same comparison runs on the simulator: each
replica a `SimEngine` with its own virtual clock (replicas side by side, each
on its own accelerator, unlike a local cluster's shared cores), the same
routing policy code (the baselines too), and Ray Serve's default modelled as
power of two choices on requests in flight (`planning/fleet.py`). `--repeats` seeds the
default router's random choices differently each time.

    .venv/bin/python bench/router.py --simulate bench/profiles/llama-small-2core.json --num-sessions 24 \
        --loads 16 --max-wait-s 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from bench.serve_bench import add_serve_args, engine_kwargs, load_bench_trace, start_cluster

MiB = 1 << 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_args(p, max_context=1500, token_scale=128.0, max_wait_s=5.0, device_kv_bytes=96 * MiB)
    p.add_argument("--loads", default="8", help="closed loop: concurrent agents (comma-separated sweep)")
    p.add_argument("--simulate", metavar="PROFILE", default=None,
                   help="run on the simulator with this cost profile (JSON or built-in name) instead of Ray")
    p.add_argument("--repeats", type=int, default=1, help="with --simulate: runs, seeds seed..seed+repeats-1")
    p.add_argument("--baselines", default="pow2,sticky,prefix,prefix-load",
                   help=f"comma list of {', '.join(BASELINES)}")
    args = p.parse_args()
    args.routers = [b.strip() for b in args.baselines.split(",") if b.strip()]
    if not args.routers or set(args.routers) - set(BASELINES):
        p.error(f"--baselines: choose from {', '.join(BASELINES)}")
    args.routers.append("session_kv")
    if args.simulate is None and args.repeats != 1:
        p.error("--repeats needs --simulate")
    if args.simulate is not None:
        simulate(args)
        return

    import ray
    from ray import serve

    from sessionserve.cli_bench import _machine
    from sessionserve.modelgen.make_model import ensure_model
    from sessionserve.router.ray_app import ServeOptions, build_app
    from sessionserve.workload.http_backend import HttpBackend
    from sessionserve.workload.replay import LoadSpec
    from sessionserve.workload.sweep import run_http

    model_dir = ensure_model("llama", args.model_size)
    trace = load_bench_trace(args)
    loads = [LoadSpec("closed", concurrency=int(x)) for x in args.loads.split(",")]
    engine = engine_kwargs(args)
    out = Path(args.out or ROOT / "bench" / "out" / f"router-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)

    port = start_cluster(args.threads)
    import httpx

    runs, cpu = {}, {}
    try:
        for name in args.routers:  # one app at a time: the others' replicas hold no memory meanwhile
            opts = ServeOptions(num_replicas=args.replicas, model=str(model_dir), model_name="m",
                                engine_kwargs=engine, store_url=f"sqlite://{out / (name + '.db')}", router=name,
                                replica_num_cpus=0)
            serve.run(build_app(opts), name=name, route_prefix=f"/{name}")
            url = f"http://127.0.0.1:{port}/{name}"
            before = replicas_cpu_s(name)
            runs.update(run_http(trace, LABELS[name], loads, lambda url=url: HttpBackend(url, model="m",
                                                                                          seed=args.seed),
                                 seed=args.seed))
            cpu[LABELS[name]] = replicas_cpu_s(name) - before
            if name != "pow2":
                (out / f"{name}-router-stats.json").write_text(httpx.get(url + "/router/stats", timeout=30).text)
            serve.delete(name)
    finally:
        serve.shutdown()
        ray.shutdown()
    meta = {"command": shlex.join([".venv/bin/python", "bench/router.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": f"embedded llama {args.model_size}",
            "machine": _machine(), "backend": f"HTTP via Ray Serve, {args.replicas} replicas per app",
            "settings": {**engine, "loads": args.loads, "max_steps": args.max_steps, "seed": args.seed}}
    summarize_runs(trace, runs, meta, out, cpu)


BASELINES = ("pow2", "sticky", "prefix", "prefix-load")
LABELS = {"pow2": "ray_default_router", "sticky": "sticky_session_router", "prefix": "prefix_aware_router",
          "prefix-load": "prefix_load_router", "session_kv": "session_kv_router"}
SIM_NAMES = {"pow2": "p2c", "sticky": "sticky", "prefix": "prefix", "prefix-load": "prefix-load",
             "session_kv": "session"}


def replicas_cpu_s(app: str) -> float:
    """CPU seconds (user + system) the engine replicas of Serve app `app` have used so far, read from /proc: the
    cluster is local, and Ray names each replica's process `ray::ServeReplica:<app>:<deployment>`."""
    from sessionserve.router.ray_app import ENGINE_DEPLOYMENT
    from sessionserve.workload.server_process import cpu_s, proc_stat

    title, total = f"ray::ServeReplica:{app}:{ENGINE_DEPLOYMENT}".encode(), 0.0
    for proc in Path("/proc").iterdir():
        try:
            if not (proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(title)):
                continue
        except OSError:  # the process ended meanwhile
            continue
        if (fields := proc_stat(proc.name)) is not None:
            total += cpu_s(fields)
    return total


def summarize_runs(trace, runs, meta, out: Path, cpu_s: dict[str, float] | None = None) -> None:
    """Report, summary table and ratios of one comparison (Ray's default router is the report's baseline when
    it ran); ours vs every baseline. `cpu_s`: per label, the CPU seconds its engine replicas used during its
    run (a real cluster's only)."""
    from sessionserve.workload.report import fmt, write_report
    from sessionserve.workload.results import build_results

    out.mkdir(parents=True, exist_ok=True)
    results = build_results(trace, runs, meta=meta, baseline=LABELS["pow2"])
    write_report(out, results, runs)
    series = results["policies"]
    o = series[LABELS["session_kv"]]

    def ratio(x: float | None, y: float | None) -> str:
        return f"{x / y:.2f}x" if x and y else "n/a"

    lines = ["| router | cached prompt fraction | TTFT p50 s | TTFT p99 s | sessions/h | sustained sessions/h | "
             "JCT p50 s | failed |",
             "|---|---|---|---|---|---|---|---|"]
    for label, s in series.items():
        lines.append(f"| {label} | {fmt(s['cached_fraction'], 3)} | {fmt(s['ttft_p50_s'], 3)} | "
                     f"{fmt(s['ttft_p99_s'], 3)} | {fmt(s['sessions_per_hour'], 1)} | "
                     f"{fmt(s['sessions_per_hour_sustained'], 1)} | {fmt(s['jct_p50_s'])} | {s['num_failed']} |")
    for label, b in series.items():
        if b is o:
            continue
        lines.append(f"\nours vs {label}: cached fraction {ratio(o['cached_fraction'], b['cached_fraction'])}, "
                     f"TTFT p50 {ratio(b['ttft_p50_s'], o['ttft_p50_s'])} lower, TTFT p99 "
                     f"{ratio(b['ttft_p99_s'], o['ttft_p99_s'])} lower, sessions/h "
                     f"{ratio(o['sessions_per_hour'], b['sessions_per_hour'])} (sustained "
                     f"{ratio(o['sessions_per_hour_sustained'], b['sessions_per_hour_sustained'])})")
    if cpu_s:
        n = len(trace.sessions)
        lines.append("engine replicas' CPU: " + ", ".join(f"{label} {c:.1f} s ({c / n:.2f} s per session)"
                                                          for label, c in cpu_s.items()))
        results["replicas_cpu_s"] = cpu_s
    summary = "\n".join(lines)
    (out / "summary.md").write_text(summary + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(summary)
    print(f"report: {out}")


def simulate(args: argparse.Namespace) -> None:
    """The comparison on the simulator: a fleet of `--replicas` simulated engines per router, `--repeats`
    seeds; one report per seed and the ratios of every seed."""
    from sessionserve.cli_bench import _machine
    from sessionserve.sim.engine import SimEngine
    from sessionserve.planning.fleet import simulate_fleet
    from sessionserve.sim.profile import load_profile
    from sessionserve.planning.runs import sim_config
    from sessionserve.workload.replay import LoadSpec
    from sessionserve.workload.sweep import with_replay_ttl

    profile = load_profile(args.simulate)
    trace = load_bench_trace(args)
    loads = [LoadSpec("closed", concurrency=int(x)) for x in args.loads.split(",")]
    engine = with_replay_ttl(trace, engine_kwargs(args))
    out_root = Path(args.out or ROOT / "bench" / "out" / f"router-sim-{time.strftime('%Y%m%d-%H%M%S')}")
    for r in range(args.repeats):
        seed = args.seed + r
        runs = {}
        for name in args.routers:
            runs[LABELS[name]] = []
            for load in loads:
                engines = [SimEngine(sim_config("predictive", engine), profile) for _ in range(args.replicas)]
                result = simulate_fleet(engines, trace.sessions, load, SIM_NAMES[name], seed=seed)
                for eng in engines:
                    eng.kv.check_integrity()
                runs[LABELS[name]].append(result)
        meta = {"command": shlex.join([".venv/bin/python", "bench/router.py", *sys.argv[1:]]),
                "date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": f"{profile.model.name} (profile {profile.label})",
                "machine": _machine(), "backend": f"SIMULATED fleet: {args.replicas} replicas, each on its own "
                                                  f"virtual clock, profile {profile.label}",
                "settings": {**engine, "loads": args.loads, "max_steps": args.max_steps, "seed": seed}}
        print(f"seed {seed}:")
        summarize_runs(trace, runs, meta, out_root / f"seed{seed}")
        for label, rs in runs.items():
            print(f"  {label}: steps moved to another replica {sum(x.extra['moves'] for x in rs)}, history "
                  f"tokens a replica lacked {sum(x.extra['history_tokens_resent'] for x in rs):,}")


if __name__ == "__main__":
    main()
