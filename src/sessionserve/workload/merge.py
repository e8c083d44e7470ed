"""One load sweep from several `sessionserve bench` runs: merge their results.json files.

A sweep over many loads with enough sessions per point takes hours, so it is
run in parts (the light loads with fewer sessions, a heavy load on its own, a
repeat). Merging pools every run's load points per series, recomputes each
series' goodput at the SLO over all of them (a load in several runs counts
with the median of its runs, see `metrics.goodput_at_slo`) and the ratios to
the baseline, and keeps each run's command and date. Runs must replay the
same trace at the same scale factors, model, machine and settings (the loads
and the number of sessions may differ) and share one SLO: anything else would
compare different experiments, and is refused with the field that differs.

Pure: dicts in, dict out (the CLI reads and writes the files).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sessionserve.workload.results import RESULTS_VERSION, build_series

# Settings a run may differ in (the sweep's loads), and what a run measured about its servers (kept per run in
# `merged_from`); every other setting must match.
RUN_FACTS = ("server_startup_s", "server_recompute_tokens", "server_counters", "subagents")
PER_RUN_SETTINGS = ("loads", "server_commands", *RUN_FACTS)
REQUIRED_KEYS = ("version", "trace", "policies", "slo_jct_p99_s", "slo_rule")


class MergeError(ValueError):
    """The runs cannot be merged: they differ in something other than their loads."""


def _same(runs: Sequence[dict[str, Any]], what: str, get: Any) -> Any:
    values = [get(r) for r in runs]
    for i, v in enumerate(values[1:], start=1):
        if v != values[0]:
            raise MergeError(f"run {i + 1} differs from run 1 in {what}: {v!r} vs {values[0]!r}")
    return values[0]


def _server_commands(runs: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Every server's command over the runs (the runs may run different servers); a server run with different
    commands in two runs is a different experiment."""
    commands: dict[str, str] = {}
    for i, r in enumerate(runs):
        for name, cmd in r.get("settings", {}).get("server_commands", {}).items():
            if commands.setdefault(name, cmd) != cmd:
                raise MergeError(f"run {i + 1} runs server {name!r} differently: {cmd!r} vs {commands[name]!r}")
    return commands


def merge_results(runs: Sequence[dict[str, Any]], *, command: str, slo_jct_s: float | None = None,
                  baseline: str = "discard") -> dict[str, Any]:
    """results.json of the pooled sweep. `slo_jct_s` overrides the runs' SLO (required if theirs differ)."""
    if not runs:
        raise MergeError("no runs to merge")
    for i, r in enumerate(runs):
        if not isinstance(r, dict) or any(k not in r for k in REQUIRED_KEYS):
            missing = [k for k in REQUIRED_KEYS if not isinstance(r, dict) or k not in r]
            raise MergeError(f"run {i + 1} is not the results.json of a bench run (no {', '.join(missing)})")
        if r["version"] != RESULTS_VERSION:
            raise MergeError(f"run {i + 1}: results version {r['version']!r}, expected {RESULTS_VERSION}")
    _same(runs, "trace", lambda r: r["trace"]["name"])
    token_scale = _same(runs, "token scale", lambda r: r["trace"]["token_scale"])
    time_scale = _same(runs, "time scale", lambda r: r["trace"]["time_scale"])
    model = _same(runs, "model", lambda r: r.get("model"))
    machine = _same(runs, "machine", lambda r: r.get("machine"))
    settings = _same(runs, "settings", lambda r: {k: v for k, v in r.get("settings", {}).items()
                                                  if k not in PER_RUN_SETTINGS})
    commands = _server_commands(runs)
    if slo_jct_s is not None:
        slo_rule = "given when merging"
    else:
        slo_jct_s = _same(runs, "SLO (pass one to merge runs with different SLOs)", lambda r: r["slo_jct_p99_s"])
        slo_rule = _same(runs, "SLO rule", lambda r: r["slo_rule"])

    summaries: dict[str, list[dict[str, Any]]] = {}
    for i, r in enumerate(runs):
        for name, series in r["policies"].items():
            summaries.setdefault(name, []).extend({**p, "run": i + 1} for p in series["loads"])
    for points in summaries.values():
        points.sort(key=lambda p: p["load_level"])  # stable: a repeated load keeps the runs' order
    base = baseline if baseline in summaries else next(iter(summaries))

    # Provenance lines every run shares once; a line that depends on the run's selection (counts in it) per run.
    common = [line for line in runs[0]["trace"]["provenance"]
              if all(line in r["trace"]["provenance"] for r in runs[1:])]
    own = [f"run {i + 1}: {line}" for i, r in enumerate(runs) for line in r["trace"]["provenance"]
           if line not in common]
    dates = [r.get("date", "") for r in runs]
    return {
        "version": RESULTS_VERSION,
        "command": command,
        "date": " .. ".join(sorted({min(dates), max(dates)})),
        "model": model, "machine": machine,
        "backend": " / ".join(dict.fromkeys(r.get("backend", "") for r in runs)),
        "settings": {**settings, "loads": " + ".join(str(r.get("settings", {}).get("loads", "")) for r in runs),
                     **({"server_commands": commands} if commands else {})},
        "trace": {"name": runs[0]["trace"]["name"],
                  "num_sessions": max(r["trace"]["num_sessions"] for r in runs),
                  "num_steps": max(r["trace"]["num_steps"] for r in runs),
                  "token_scale": token_scale, "time_scale": time_scale, "provenance": common + own},
        "merged_from": [{"run": i + 1, "command": r.get("command", ""), "date": r.get("date", ""),
                         "backend": r.get("backend", ""), "num_sessions": r["trace"]["num_sessions"],
                         "num_steps": r["trace"]["num_steps"], "series": list(r["policies"]),
                         "loads": r.get("settings", {}).get("loads"),
                         **{k: r["settings"][k] for k in RUN_FACTS if k in r.get("settings", {})}}
                        for i, r in enumerate(runs)],
        "baseline": base,
        "reference_load": summaries[base][-1]["load"],
        "slo_jct_p99_s": slo_jct_s, "slo_rule": slo_rule,
        "policies": build_series(summaries, slo_jct_s, base),
    }
