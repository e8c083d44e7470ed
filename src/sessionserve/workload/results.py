"""The content of `results.json`: per series (policy) headline figures, the load sweep, the SLO and its rule.

Headline figures (JCT, TTFT, recompute, prefetch) are taken at the reference
load: the heaviest load of the sweep, where memory pressure is highest.
Goodput is the best sessions per hour over the loads that meet the p99 JCT SLO.
Ratios are to the `baseline` series (`discard` when present).
"""

from __future__ import annotations

from typing import Any

from sessionserve.workload.metrics import LoadPoint, default_slo_s, goodput_at_slo, ratio, summarize
from sessionserve.workload.replay import ReplayResult
from sessionserve.workload.trace import TraceSet

RESULTS_VERSION = 1
HEADLINE_KEYS = ("jct_p50_s", "jct_p99_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "recompute_tokens",
                 "prefetch_hit_rate", "cached_fraction", "cpu_busy_fraction", "num_failed")


def load_points(summaries: list[dict[str, Any]]) -> list[LoadPoint]:
    return [LoadPoint(s["load_level"], s["sessions_per_hour"], s["jct_p99_s"], s["num_failed"]) for s in summaries]


def build_series(summaries: dict[str, list[dict[str, Any]]], slo_jct_s: float | None, baseline: str
                 ) -> dict[str, Any]:
    """results.json's "policies": per series its goodput at the SLO over its loads, the headline figures at
    its heaviest load (the last of `summaries[name]`), every load's summary, and ratios to `baseline`."""
    series: dict[str, Any] = {}
    for name, sums in summaries.items():
        ref = sums[-1]
        series[name] = {
            "sessions_per_hour_at_slo": goodput_at_slo(load_points(sums), slo_jct_s) if slo_jct_s else None,
            "reference_load": ref["load"],
            "sessions_per_hour": ref["sessions_per_hour"],
            "sessions_per_hour_sustained": ref.get("sessions_per_hour_sustained"),
            **{k: ref[k] for k in HEADLINE_KEYS},
            "loads": sums,
        }
    b = series[baseline]
    for s in series.values():
        s["vs_baseline"] = {k: ratio(s[k], b[k]) for k in ("sessions_per_hour_at_slo", "sessions_per_hour",
                                                           "sessions_per_hour_sustained",
                                                           "jct_p50_s", "jct_p99_s", "ttft_p99_s", "recompute_tokens")}
    return series


def build_results(trace: TraceSet, runs: dict[str, list[ReplayResult]], *, meta: dict[str, Any],
                  slo_jct_s: float | None = None, slo_factor: float = 2.0, baseline: str = "discard"
                  ) -> dict[str, Any]:
    """results.json as a dict. `meta`: command, model, machine, settings (copied verbatim)."""
    summaries = {name: [summarize(r) for r in results] for name, results in runs.items()}
    base = baseline if baseline in runs else next(iter(runs))
    if slo_jct_s is None:
        slo_jct_s = default_slo_s(load_points(summaries[base]), slo_factor)
        slo_rule = (f"{slo_factor:g} x the p99 JCT of '{base}' at its lightest load "
                    f"({summaries[base][0]['load']})")
    else:
        slo_rule = "given on the command line"
    series = build_series(summaries, slo_jct_s, base)
    return {
        "version": RESULTS_VERSION,
        **meta,
        "trace": {"name": trace.name, "num_sessions": len(trace.sessions),
                  "num_steps": sum(len(s.steps) for s in trace.sessions),
                  "token_scale": trace.token_scale, "time_scale": trace.time_scale,
                  "provenance": list(trace.provenance)},
        "baseline": base,
        "reference_load": summaries[base][-1]["load"],
        "slo_jct_p99_s": slo_jct_s, "slo_rule": slo_rule,
        "policies": series,
    }
