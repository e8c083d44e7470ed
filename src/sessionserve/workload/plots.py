"""The report's PNG plots (matplotlib, Agg backend, so no display is needed).

jct_cdf.png: session JCT CDF per policy (reference load); goodput.png:
sessions/hour and p99 JCT vs load with the SLO line; kv_tiers.png: KV bytes
per tier over time per policy (reference load); ttft.png: step TTFT CDF.
"""

from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Any

from sessionserve.workload.metrics import cdf
from sessionserve.workload.replay import ReplayResult

PLOT_FILES = ("jct_cdf.png", "goodput.png", "kv_tiers.png", "ttft.png")
MiB = 1 << 20


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # NOTE: before pyplot is imported: no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path, subtitle: str) -> Path:
    fig.suptitle(subtitle, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_goodput_plot(out_dir: Path, results: dict[str, Any], subtitle: str) -> Path:
    """goodput.png from results.json's content alone (a merged sweep has no raw runs for the other plots). A load
    run more than once is drawn at the median of its runs, each run a dot beside it."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    slo = results.get("slo_jct_p99_s")
    levels: set[float] = set()
    for name, series in results["policies"].items():
        runs: dict[float, list[dict[str, Any]]] = {}
        for point in series["loads"]:
            runs.setdefault(point["load_level"], []).append(point)
        xs = sorted(runs)
        levels.update(xs)
        rate = [median(p["sessions_per_hour"] or 0 for p in runs[x]) for x in xs]
        line, = ax1.plot(xs, rate, marker="o", label=name)
        met = [r if slo and all(p["jct_p99_s"] is not None and p["jct_p99_s"] <= slo for p in runs[x]) else 0
               for x, r in zip(xs, rate)]
        ax1.plot(xs, met, marker="x", linestyle=":", color=line.get_color())
        ax2.plot(xs, [median(p["jct_p99_s"] or 0 for p in runs[x]) for x in xs], marker="o", label=name)
        if any(len(r) > 1 for r in runs.values()):
            ax1.scatter([x for x in xs for _ in runs[x]], [p["sessions_per_hour"] or 0 for x in xs for p in runs[x]],
                        s=10, alpha=0.5, color=line.get_color())
    if slo:
        ax2.axhline(slo, color="red", linestyle="--", label=f"SLO {slo:.1f} s")
    closed = results.get("settings", {}).get("mode") == "closed"
    load_axis = "load (concurrent agents)" if closed else "load (sessions/s)"
    if closed and levels and min(levels) > 0 and max(levels) >= 4 * min(levels):  # 1, 2, 4, ... agents
        for ax in (ax1, ax2):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(levels), [f"{x:g}" for x in sorted(levels)])
    ax1.set(xlabel=load_axis, ylabel="sessions / hour", title="throughput (o, median of runs) and goodput at SLO (x)")
    ax2.set(xlabel=load_axis, ylabel="p99 JCT (s)", title="p99 JCT vs load")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    return _save(plt, fig, out_dir / "goodput.png", subtitle)


def write_plots(out_dir: Path, runs: dict[str, list[ReplayResult]], results: dict[str, Any], subtitle: str
                ) -> list[Path]:
    """Write the four PNGs into `out_dir`; returns their paths."""
    plt = _plt()
    paths: list[Path] = []

    def save(fig: Any, name: str) -> None:
        paths.append(_save(plt, fig, out_dir / name, subtitle))

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rs in runs.items():
        xs, ys = cdf(s.jct_s for s in rs[-1].sessions if s.jct_s is not None)
        ax.step(xs, ys, where="post", label=name)
    ax.set(xlabel="session JCT (s, replay time)", ylabel="fraction of sessions",
           title=f"JCT CDF at {results['reference_load']}")
    ax.legend()
    save(fig, "jct_cdf.png")

    paths.append(write_goodput_plot(out_dir, results, subtitle))

    tiers = (("device_bytes", "device"), ("host_bytes", "host"), ("disk_bytes", "disk"))
    fig, axes = plt.subplots(1, len(tiers), figsize=(12, 3.6), sharex=True)
    for name, rs in runs.items():
        samples = rs[-1].kv_samples
        for ax, (key, _) in zip(axes, tiers):
            ax.plot([s["t_s"] for s in samples], [s.get(key, 0) / MiB for s in samples], label=name)
    for ax, (_, title) in zip(axes, tiers):
        ax.set(xlabel="time (s)", ylabel="KV MiB", title=f"{title} tier")
    axes[0].legend(fontsize=7)
    if not any(rs[-1].kv_samples for rs in runs.values()):
        axes[1].text(0.5, 0.5, "not reported by this backend", ha="center", transform=axes[1].transAxes)
    save(fig, "kv_tiers.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rs in runs.items():
        xs, ys = cdf(r.result.ttft_s for r in rs[-1].steps if r.result.ttft_s is not None)
        ax.step(xs, ys, where="post", label=name)
    ax.set(xlabel="TTFT (s)", ylabel="fraction of steps", title=f"step TTFT CDF at {results['reference_load']}")
    if any(r.result.ttft_s for rs in runs.values() for r in rs[-1].steps):
        ax.set_xscale("log")
    ax.legend()
    save(fig, "ttft.png")
    return paths
