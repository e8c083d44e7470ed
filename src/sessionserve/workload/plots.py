"""The report's PNG plots (matplotlib, Agg backend, so no display is needed).

jct_cdf.png: session JCT CDF per policy (reference load); goodput.png:
sessions/hour and p99 JCT vs load with the SLO line; kv_tiers.png: KV bytes
per tier over time per policy (reference load); ttft.png: step TTFT CDF.
"""

from __future__ import annotations

from pathlib import Path
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
    """goodput.png from results.json's content alone (a merged sweep has no raw runs for the other plots)."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    slo = results.get("slo_jct_p99_s")
    for name, series in results["policies"].items():
        loads = series["loads"]
        xs = [s["load_level"] for s in loads]
        ax1.plot(xs, [s["sessions_per_hour"] or 0 for s in loads], marker="o", label=name)
        ok = [s["sessions_per_hour"] if slo and s["jct_p99_s"] is not None and s["jct_p99_s"] <= slo else 0
              for s in loads]
        ax1.plot(xs, ok, marker="x", linestyle=":", color=ax1.lines[-1].get_color())
        ax2.plot(xs, [s["jct_p99_s"] or 0 for s in loads], marker="o", label=name)
    if slo:
        ax2.axhline(slo, color="red", linestyle="--", label=f"SLO {slo:.1f} s")
    load_axis = "load (concurrent agents)" if results.get("settings", {}).get("mode") == "closed" else \
        "load (sessions/s)"
    ax1.set(xlabel=load_axis, ylabel="sessions / hour", title="throughput (o) and goodput at SLO (x)")
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
