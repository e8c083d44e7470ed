"""`sessionserve bench` and `sessionserve demo`: replay an agent trace, compare policies, write a report folder.

    sessionserve bench --trace weka_claude_code --policies discard,keep,ttl,least-waste,predictive --out DIR
    sessionserve bench --trace mooncake_conversation --backend http --url http://127.0.0.1:8000
    sessionserve demo
    sessionserve merge-reports DIR1 DIR2 ... --out DIR   # one sweep from runs of its parts

The trace folder is ../shared/traces beside the repository, or --traces-dir,
or $SESSIONSERVE_TRACES_DIR (read here only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from sessionserve.config import ADMISSION_MODES
from sessionserve.obs.machine import cpu_model_name

MiB = 1 << 20
POLICIES = "discard,keep,ttl,least-waste,predictive"


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `sessionserve bench` (the demo reuses them with short defaults)."""
    g = parser.add_argument_group("workload")
    g.add_argument("--trace", default="weka_claude_code", help="trace name under the traces folder, or any "
                   "file/folder in a supported format (weka, mooncake, azure, tracelab, sessionserve JSONL)")
    g.add_argument("--traces-dir", default=None, help="folder of named traces (default: ../shared/traces)")
    g.add_argument("--num-sessions", type=int, default=24)
    g.add_argument("--max-steps", type=int, default=8, help="cut sessions to this many LLM steps")
    g.add_argument("--min-steps", type=int, default=None, help="drop shorter sessions (default: --max-steps)")
    g.add_argument("--max-context", type=int, default=1500, help="cut a session before its scaled context "
                   "exceeds this many tokens")
    g.add_argument("--token-scale", type=float, default=128.0, help="divide trace token counts by this")
    g.add_argument("--time-scale", type=float, default=10.0, help="divide trace durations by this")
    g.add_argument("--max-wait-s", type=float, default=30.0, help="cap on one scaled wait (human waits are long)")
    g.add_argument("--wait-source", default="tracelab", choices=("tracelab", "trace"),
                   help="mooncake: synthesise tool waits (tracelab) or use the trace's gaps")
    g.add_argument("--save-trace", default=None, help="also write the scaled agent trace as JSONL here")
    g = parser.add_argument_group("load")
    g.add_argument("--mode", default="closed", choices=("closed", "open"))
    g.add_argument("--loads", default="4,8,12", help="closed: concurrent agents; open: sessions/s, or 'trace' "
                   "for the trace's arrivals; comma-separated sweep")
    g.add_argument("--slo-jct-s", type=float, default=None, help="p99 JCT SLO (default: --slo-factor x the "
                   "baseline's p99 JCT at the lightest load)")
    g.add_argument("--slo-factor", type=float, default=2.0)
    g.add_argument("--seed", type=int, default=0)
    g = parser.add_argument_group("server")
    g.add_argument("--policies", default=POLICIES, help="residency policies to compare (inproc)")
    g.add_argument("--backend", default="inproc", choices=("inproc", "http"))
    g.add_argument("--url", default="http://127.0.0.1:8000", help="http: the server root")
    g.add_argument("--api-key", default=None)
    g.add_argument("--no-sessions", action="store_true", help="http: the server has no /v1/sessions")
    g.add_argument("--served-model", default=None, help="http: model name (default: the first of /v1/models)")
    g.add_argument("--vocab-size", type=int, default=16_384, help="http: token ids sent are below this")
    g.add_argument("--label", default=None, help="http: the series name in the report (default: the URL)")
    g.add_argument("--model", default=None, help="inproc: HF model folder (default: the embedded model)")
    g.add_argument("--model-size", default="small", choices=("tiny", "small"), help="embedded model size")
    g.add_argument("--device-kv-bytes", type=int, default=160 * MiB)
    g.add_argument("--host-kv-bytes", type=int, default=2048 * MiB)
    g.add_argument("--host-kv-int8", action="store_true",
                   help="inproc/simulate: the host tier stores KV as int8 (serve --host-kv-int8)")
    g.add_argument("--disk-kv-bytes", type=int, default=0)
    g.add_argument("--max-num-seqs", type=int, default=32)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024)
    g.add_argument("--threads", type=int, default=None)
    g.add_argument("--admission", choices=ADMISSION_MODES, default="auto",
                   help="inproc/simulate: session admission by working set (serve --admission)")
    g.add_argument("--admission-fill", type=float, default=1.2,
                   help="inproc/simulate: share of the device KV the admitted sessions may fill")
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="inproc: compute dtype (auto: the checkpoint's where the device runs it fast)")
    g.add_argument("--hint-waits", action="store_true", help="tell the engine each true wait (an oracle hint)")
    parser.add_argument("--out", default=None, help="report folder (default: bench/out/<trace>-<time>)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _loads(args: argparse.Namespace) -> list[Any]:
    from sessionserve.workload.replay import LoadSpec

    loads = []
    for item in str(args.loads).split(","):
        item = item.strip()
        if args.mode == "closed":
            loads.append(LoadSpec("closed", concurrency=int(item)))
        else:
            loads.append(LoadSpec("open", rate_per_s=None if item == "trace" else float(item)))
    return sorted(loads, key=lambda load: load.level)


def _machine() -> str:
    cpu = cpu_model_name()
    return f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def _model_text(model_dir: Path) -> str:
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return str(model_dir)
    arch = (cfg.get("architectures") or ["?"])[0]
    return (f"{model_dir.name} ({arch}, {cfg.get('num_hidden_layers')} layers, hidden {cfg.get('hidden_size')}, "
            f"vocab {cfg.get('vocab_size')})")


def run_bench(args: argparse.Namespace) -> Path:
    """Load the trace, run the sweep, write the report folder; returns report.md's path."""
    from sessionserve.workload.loader import load_trace
    from sessionserve.workload.progress import Progress
    from sessionserve.workload.report import write_report
    from sessionserve.workload.results import build_results
    from sessionserve.workload.sweep import run_http, run_inproc, warm_up
    from sessionserve.workload.trace_io import write_jsonl

    traces_dir = args.traces_dir or os.environ.get("SESSIONSERVE_TRACES_DIR")
    trace = load_trace(args.trace, traces_dir=traces_dir, token_scale=args.token_scale, time_scale=args.time_scale,
                       max_sessions=args.num_sessions, max_steps=args.max_steps,
                       min_steps=args.min_steps if args.min_steps is not None else args.max_steps,
                       max_context_tokens=args.max_context, max_wait_s=args.max_wait_s, seed=args.seed,
                       wait_source=args.wait_source)
    if not trace.sessions:
        raise SystemExit(f"no sessions of {args.trace} pass the filters (try lower --min-steps or higher "
                         "--max-context)")
    if args.save_trace:
        write_jsonl(trace, args.save_trace)
    loads = _loads(args)
    out = Path(args.out or Path("bench") / "out" / f"{trace.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"trace {trace.name}: {len(trace.sessions)} sessions, {sum(len(s.steps) for s in trace.sessions)} "
          f"steps; token counts / {trace.token_scale:g}, times / {trace.time_scale:g}", file=sys.stderr)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    progress = None if args.quiet else Progress(len(trace.sessions) * len(loads) * (
        len(policies) if args.backend == "inproc" else 1))
    settings: dict[str, Any] = {"mode": args.mode, "loads": args.loads, "seed": args.seed,
                                "max_steps": args.max_steps, "max_context_tokens": args.max_context,
                                "max_wait_s": args.max_wait_s}
    if args.backend == "inproc":
        from sessionserve.modelgen.make_model import ensure_model

        model_dir = Path(args.model) if args.model else ensure_model("llama", args.model_size)
        engine_kwargs = dict(kv_cache_bytes=args.device_kv_bytes, host_kv_bytes=args.host_kv_bytes,
                             disk_kv_bytes=args.disk_kv_bytes, num_threads=args.threads,
                             max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             dtype=args.dtype, admission=args.admission, admission_fill=args.admission_fill,
                             host_kv_int8=args.host_kv_int8)
        settings.update({k: v for k, v in engine_kwargs.items() if v is not None}, hint_waits=args.hint_waits)
        warm_up(model_dir, {**engine_kwargs, "residency_policy": policies[0]}, args.seed)
        runs = run_inproc(trace, policies, loads, model_dir, engine_kwargs, seed=args.seed,
                          hint_waits=args.hint_waits, progress=progress)
        model_text, backend_text = _model_text(model_dir), "in-process engine"
    else:
        from sessionserve.workload.http_backend import HttpBackend

        label = args.label or args.url
        runs = run_http(trace, label, loads, lambda: HttpBackend(
            args.url, args.api_key, not args.no_sessions, args.served_model, args.vocab_size, seed=args.seed),
            seed=args.seed, progress=progress)
        model_text = args.served_model or "(first model of /v1/models)"
        backend_text = f"HTTP {args.url} ({'with' if not args.no_sessions else 'without'} sessions)"
        settings["vocab_size"] = args.vocab_size
    if progress is not None:
        progress.close()
    meta = {"command": shlex.join(["sessionserve", *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "model": model_text, "machine": _machine(), "backend": backend_text, "settings": settings}
    results = build_results(trace, runs, meta=meta, slo_jct_s=args.slo_jct_s, slo_factor=args.slo_factor)
    report = write_report(out, results, runs)
    _print_summary(results)
    print(f"report: {report}")
    return report


def _print_summary(results: dict[str, Any]) -> None:
    print(f"\nat {results['reference_load']}; SLO p99 JCT <= {results['slo_jct_p99_s'] or 0:.1f} s")
    for name, s in results["policies"].items():
        print(f"  {name:12s} {s['sessions_per_hour_at_slo'] or 0:8.1f} sessions/h at SLO   JCT p50 "
              f"{s['jct_p50_s'] or 0:6.2f} s p99 {s['jct_p99_s'] or 0:6.2f} s   TTFT p99 {s['ttft_p99_s'] or 0:.3f} s"
              f"   recompute {s['recompute_tokens'] or 0:,.0f} tok   failed {s['num_failed']}")
    base = results.get("baseline")
    for name, s in results["policies"].items():
        vs = s.get("vs_baseline", {})
        if name != base and vs.get("sessions_per_hour"):
            at_slo = vs.get("sessions_per_hour_at_slo")
            print(f"  {name} vs {base}: {vs['sessions_per_hour']:.2f}x sessions/h at {results['reference_load']}"
                  + (f", {at_slo:.2f}x at the SLO" if at_slo else ""))


def add_merge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("reports", nargs="+", help="report folders (or their results.json) of `sessionserve bench` "
                        "runs of one trace, model, machine and settings; their loads may differ")
    parser.add_argument("--out", required=True, help="folder for the merged results.json, report.md, goodput.png")
    parser.add_argument("--slo-jct-s", type=float, default=None, help="p99 JCT SLO (default: the runs' own, "
                        "which must then agree)")
    parser.add_argument("--baseline", default="discard", help="series the ratios are to (default: discard, or "
                        "the first series)")


def run_merge(args: argparse.Namespace) -> Path:
    """Pool the load sweeps of several report folders into one report (goodput at the SLO over all loads)."""
    from sessionserve.workload.merge import MergeError, merge_results
    from sessionserve.workload.report import write_report

    runs = []
    for folder in args.reports:
        path = Path(folder)
        path = path / "results.json" if path.is_dir() else path
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"cannot read {path}: {exc}") from None
    try:
        results = merge_results(runs, command=shlex.join(["sessionserve", *sys.argv[1:]]), slo_jct_s=args.slo_jct_s,
                                baseline=args.baseline)
    except MergeError as exc:
        raise SystemExit(f"cannot merge: {exc}") from None
    report = write_report(args.out, results, None)
    _print_summary(results)
    print(f"report: {report}")
    return report


# Device KV short, as on the users' GPUs: 32 MiB holds ~1.4k tokens of llama-small (fp32), under one agent's
# context (up to 2,000 tokens here); a 256 MiB host tier beside it, for both policies. Six agents.
DEMO_DEFAULTS = dict(num_sessions=8, max_steps=5, max_context=2000, loads="6", policies="discard,predictive",
                     device_kv_bytes=32 * MiB, host_kv_bytes=256 * MiB, max_wait_s=3.0)


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """`sessionserve demo`: the bench flags with short defaults (a few minutes on 2 CPU cores): a stateless
    server (`discard`) and ours (`predictive`) where the device KV cannot hold the agents' contexts."""
    add_bench_arguments(parser)
    parser.set_defaults(**DEMO_DEFAULTS)


def run_demo(args: argparse.Namespace) -> Path:
    """A short bench on the embedded model (small unless --model-size tiny); prints where the report is."""
    for key, value in DEMO_DEFAULTS.items():  # a parser without some demo flags still gets their defaults
        if not hasattr(args, key):
            setattr(args, key, value)
    if args.out is None:
        args.out = str(Path("bench") / "out" / "demo")
    print(f"demo: {args.num_sessions} Claude Code sessions x {args.max_steps} steps, {args.loads} agents at once; "
          f"device KV {args.device_kv_bytes / MiB:.0f} MiB (short, as on a GPU), host tier "
          f"{args.host_kv_bytes / MiB:.0f} MiB; policies {args.policies}", file=sys.stderr)
    t0 = time.monotonic()
    report = run_bench(args)
    print(f"demo finished in {time.monotonic() - t0:.0f} s; open {report} (plots beside it)")
    return report


def main(argv: list[str] | None = None) -> None:
    """Standalone entry (`python -m sessionserve.cli_bench [demo] ...`) until the CLI hooks these in."""
    argv = sys.argv[1:] if argv is None else argv
    is_demo = bool(argv) and argv[0] == "demo"
    parser = argparse.ArgumentParser(prog="sessionserve demo" if is_demo else "sessionserve bench",
                                     description=__doc__.splitlines()[0])
    (add_demo_arguments if is_demo else add_bench_arguments)(parser)
    args = parser.parse_args(argv[1:] if is_demo else argv)
    run_demo(args) if is_demo else run_bench(args)


if __name__ == "__main__":
    main()
