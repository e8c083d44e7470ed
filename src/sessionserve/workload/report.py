"""The report folder: results.json, report.md (tables with ratios to the baseline), and the PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from sessionserve.workload.plots import write_goodput_plot, write_plots
from sessionserve.workload.replay import ReplayResult


def fmt(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}x"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.0f}%"


def _merged_runs(results: dict[str, Any]) -> list[str]:
    """For a merged sweep: the runs it pools, each with its command and date."""
    merged = results.get("merged_from")
    if not merged:
        return []
    return ["Merged from:", "", *[f"- run {m['run']} ({m['date']}, {m['backend']}): `{m['command']}`" for m in merged],
            ""]


def render_markdown(results: dict[str, Any]) -> str:
    """report.md from results.json's content (pure)."""
    tr = results["trace"]
    base = results["baseline"]
    merged = results.get("merged_from")
    workload = (f"{tr['num_sessions']} sessions, {tr['num_steps']} LLM steps" if not merged else
                "; ".join(f"run {m['run']}: {m['num_sessions']} sessions, {m['num_steps']} LLM steps"
                          for m in merged))
    lines = [
        f"# Agent workload: {tr['name']}",
        "",
        f"Command: `{results.get('command', '')}`",
        "",
        *_merged_runs(results),
        f"- Date: {results.get('date', '')}; backend: {results.get('backend', '')}; model: {results.get('model', '')}",
        f"- Machine: {results.get('machine', '')}",
        f"- Settings: {', '.join(f'{k}={v}' for k, v in results.get('settings', {}).items())}",
        f"- **Scale factors: token counts / {tr['token_scale']:g}, times / {tr['time_scale']:g}** (ratios kept; "
        "all times below are replay seconds, sessions per hour are per replay hour)",
        f"- Workload: {workload}",
        "",
        "## Where the workload comes from",
        "",
        *[f"- {p}" for p in tr["provenance"]],
        "",
        f"## Results at {results['reference_load']} (ratios to `{base}`; each policy's figures at its "
        "heaviest load)" if merged else f"## Results at {results['reference_load']} (ratios to `{base}`)",
        "",
        f"SLO: p99 session JCT <= {fmt(results['slo_jct_p99_s'], 1)} s ({results['slo_rule']}). "
        "Goodput = the best sessions per hour over the loads of the sweep that meet it (a load run more than "
        "once: the median of its runs, if every run met it).",
        "",
        "| policy | load | sessions/h at SLO | vs base | sessions/h | JCT p50 s | JCT p99 s | vs base | "
        "TTFT p50 s | TTFT p99 s | vs base | recompute tokens | vs base | prefetch hit rate | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in results["policies"].items():
        vs = s["vs_baseline"]
        lines.append(
            f"| {name} | {s.get('reference_load', results['reference_load'])} | "
            f"{fmt(s['sessions_per_hour_at_slo'], 1)} | {_x(vs['sessions_per_hour_at_slo'])} | "
            f"{fmt(s['sessions_per_hour'], 1)} | {fmt(s['jct_p50_s'])} | {fmt(s['jct_p99_s'])} | "
            f"{_x(vs['jct_p99_s'])} | {fmt(s['ttft_p50_s'], 3)} | {fmt(s['ttft_p99_s'], 3)} | "
            f"{_x(vs['ttft_p99_s'])} | {fmt(s['recompute_tokens'])} | {_x(vs['recompute_tokens'])} | "
            f"{_pct(s['prefetch_hit_rate'])} | {fmt(s['num_failed'])} |")
    lines += ["", "## Load sweep", "",
              f"| policy | load |{' run |' if merged else ''} completed | sessions/h | sustained sessions/h | "
              "JCT p50 s | JCT p99 s | TTFT p99 s | TPOT p50 s | recompute tokens | cached prompt | "
              "prefetch hit rate | engine busy | cores busy | cores busy sustained | peak device KV MiB | "
              "peak host KV MiB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if merged else "")]
    for name, s in results["policies"].items():
        for p in s["loads"]:
            dev = None if p["peak_device_kv_bytes"] is None else p["peak_device_kv_bytes"] / (1 << 20)
            host = None if p["peak_host_kv_bytes"] is None else p["peak_host_kv_bytes"] / (1 << 20)
            run = f" {p.get('run')} |" if merged else ""
            lines.append(
                f"| {name} | {p['load']} |{run} {p['num_completed']}/{p['num_sessions']} | "
                f"{fmt(p['sessions_per_hour'], 1)} | {fmt(p.get('sessions_per_hour_sustained'), 1)} | "
                f"{fmt(p['jct_p50_s'])} | {fmt(p['jct_p99_s'])} | {fmt(p['ttft_p99_s'], 3)} | "
                f"{fmt(p['tpot_p50_s'], 3)} | {fmt(p['recompute_tokens'])} | "
                f"{_pct(p['cached_fraction'])} | {_pct(p['prefetch_hit_rate'])} | {_pct(p['cpu_busy_fraction'])} | "
                f"{fmt(p.get('server_cores_busy'), 2)} | {fmt(p.get('server_cores_busy_sustained'), 2)} | "
                f"{fmt(dev, 1)} | {fmt(host, 1)} |")
    errors = [(n, p["load"], p["first_error"]) for n, s in results["policies"].items() for p in s["loads"]
              if p["first_error"]]
    if errors:
        lines += ["", "Failed sessions (first error per run):", ""]
        lines += [f"- {n} @ {load}: `{err}`" for n, load, err in errors]
    stand_ins = sum(p.get("stand_in_output_steps") or 0 for s in results["policies"].values() for p in s["loads"])
    if stand_ins:
        lines += ["", f"Note: on {stand_ins:,} steps the server did not return the generated token ids, so the next "
                      "prompt repeated stand-in ids of the same length there: the server re-prefilled those output "
                      "tokens (visible as a lower cached-prompt share)."]
    lines += [
        "", "## Plots", "",
        *(["![goodput vs load](goodput.png)"] if merged else [
            "![JCT CDF](jct_cdf.png)", "![goodput vs load](goodput.png)", "![KV bytes by tier](kv_tiers.png)",
            "![TTFT](ttft.png)"]), "",
        "## Definitions", "",
        "- JCT: a session's arrival (open loop) or start (closed loop) to its last step's last token, "
        "tool waits included.",
        "- TTFT / TPOT: per LLM step, from the request entering the server.",
        "- Recompute tokens: prompt tokens prefilled again that the session had computed before (server count).",
        "- Prefetch hit rate: resumed steps whose KV was already back on device / all resumes from off device.",
        "- Engine busy: wall time the engine spent in steps with work / run time.",
        "- Cores busy (over HTTP): the server process group's CPU seconds (/proc) / the load point's wall time; "
        "sustained: over the window of sustained sessions/h only (sampled each second).",
        "- Sessions/h: completed sessions / makespan (goodput uses this). Sustained sessions/h (closed loop): "
        "sessions completed between the first completion and the last session's start / that time: the "
        "rate while every agent has a session, without the drain at the end of a finite replay.",
        "- Headline figures are at the reference load, the heaviest of the sweep.",
    ]
    return "\n".join(lines) + "\n"


def write_report(out_dir: str | Path, results: dict[str, Any], runs: dict[str, list[ReplayResult]] | None
                 ) -> Path:
    """Write results.json, report.md and the plots into `out_dir`; returns report.md's path. Without `runs`
    (a merged sweep: summaries only) the one plot drawn from the summaries, goodput vs load."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    report = out / "report.md"
    report.write_text(render_markdown(results))
    tr = results["trace"]
    subtitle = f"{tr['name']}, tokens/{tr['token_scale']:g}, time/{tr['time_scale']:g}, {results.get('model', '')}"
    if runs is None:
        write_goodput_plot(out, results, subtitle)
    else:
        write_plots(out, runs, results, subtitle)
    return report
