"""Replay results to numbers: percentiles, per-run summaries, goodput at a JCT SLO from a load sweep.

All pure functions of recorded data (no clocks), so they are tested on
hand-made inputs. Times are seconds of replay time (the trace's times divided
by its time scale); sessions per hour are per hour of replay time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from sessionserve.workload.replay import ReplayResult


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-quantile (0..1) with linear interpolation between order statistics (numpy's default); None if empty."""
    s = sorted(values)
    if not s:
        return None
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def sustained_rate_per_hour(starts: Sequence[float], ends: Sequence[float | None], agents: int) -> float | None:
    """Closed loop: sessions completed per hour while every agent is busy.

    A finite closed-loop replay ends with a drain: once the last session has
    started, agents go idle one by one, so completed / makespan counts the
    tail (set by the slowest last sessions) against the load, and agents /
    mean JCT counts the drain's sessions, which ran with fewer competitors,
    for it. Until the last start every agent has a session: the window from
    the first completion to the last start is at full load, and this is the
    number of completions inside it over its length. `ends[i]` is None for a
    failed session (its agent's time is in the window, the session is not
    counted). None for no more sessions than agents or a window without a
    completion after its first.
    """
    window = sustained_window(starts, ends, agents)
    if window is None:
        return None
    first, last_start = window
    return 3600 * (sum(1 for e in ends if e is not None and e <= last_start) - 1) / (last_start - first)


def sustained_window(starts: Sequence[float], ends: Sequence[float | None], agents: int) -> tuple[float, float] | None:
    """The full-load window of a closed-loop replay (`sustained_rate_per_hour`): its first completion and its last
    start; None where there is none (no more sessions than agents, fewer than two completions before the last
    start)."""
    if len(starts) <= agents:
        return None
    last_start = max(starts)
    done = [e for e in ends if e is not None and e <= last_start]
    if len(done) < 2 or last_start <= (first := min(done)):
        return None
    return first, last_start


def rate_between(samples: Sequence[tuple[float, float]], start: float, end: float) -> float | None:
    """The mean rate of a sampled counter over [start, end]: `samples` are (time, value) in time order, read
    linearly between samples (e.g. a server's CPU seconds: cores busy). None if the samples do not cover it."""
    if end <= start or not samples or samples[0][0] > start or samples[-1][0] < end:
        return None

    def at(t: float) -> float:
        for (t0, v0), (t1, v1) in zip(samples, samples[1:]):
            if t0 <= t <= t1:
                return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
        return samples[-1][1]

    return (at(end) - at(start)) / (end - start)


def sustained_sessions_per_hour(result: ReplayResult) -> float | None:
    """`sustained_rate_per_hour` of a closed-loop replay; None for open loop."""
    if result.load.mode != "closed":
        return None
    return sustained_rate_per_hour(*_starts_ends(result), result.load.concurrency)


def sustained_window_of(result: ReplayResult) -> tuple[float, float] | None:
    """`sustained_window` of a closed-loop replay; None for open loop."""
    if result.load.mode != "closed":
        return None
    return sustained_window(*_starts_ends(result), result.load.concurrency)


def _starts_ends(result: ReplayResult) -> tuple[list[float], list[float | None]]:
    return [s.start_s for s in result.sessions], [s.end_s for s in result.sessions]


def summarize(result: ReplayResult) -> dict[str, float | int | str | None]:
    """The headline figures of one replay run (one policy at one load)."""
    done = [s for s in result.sessions if s.end_s is not None]
    jct = [s.jct_s for s in done if s.jct_s is not None]
    ttft = [r.result.ttft_s for r in result.steps if r.result.ttft_s is not None]
    tpot = [r.result.tpot_s for r in result.steps if r.result.tpot_s is not None]
    stats: dict[str, float] = {}
    for s in (*result.sessions, *result.subagents):
        for k, v in s.stats.items():
            stats[k] = stats.get(k, 0) + v
    hits, late, misses = (stats.get(k) for k in ("num_prefetch_hits", "num_prefetch_late", "num_restore_misses"))
    restores = None if hits is None else hits + (late or 0) + (misses or 0)
    prompt = sum(r.result.num_prompt_tokens for r in result.steps)
    cached = sum(r.result.num_cached_tokens for r in result.steps)
    return {
        "load": result.load.label, "load_level": result.load.level,
        "num_sessions": len(result.sessions), "num_completed": len(done),
        "num_failed": len(result.sessions) - len(done),
        "first_error": next((s.error for s in result.sessions if s.error), None),
        "num_steps": len(result.steps), "makespan_s": result.makespan_s,
        "sessions_per_hour": 3600 * len(done) / result.makespan_s if result.makespan_s > 0 else None,
        "sessions_per_hour_sustained": sustained_sessions_per_hour(result),
        "jct_p50_s": percentile(jct, 0.5), "jct_p90_s": percentile(jct, 0.9), "jct_p99_s": percentile(jct, 0.99),
        "jct_mean_s": sum(jct) / len(jct) if jct else None,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5), "tpot_p99_s": percentile(tpot, 0.99),
        "prompt_tokens": prompt, "cached_tokens": cached, "cached_fraction": ratio(cached, prompt),
        "recompute_tokens": stats.get("num_recompute_tokens"),
        "prefilled_tokens": stats.get("num_computed_prompt_tokens"),
        "prefetch_hits": hits, "prefetch_late": late, "restore_misses": misses,
        "prefetch_hit_rate": ratio(hits, restores),
        "restore_blocked_s": stats.get("restore_blocked_s"),
        "wait_s_total": sum(s.total_wait_s for s in result.sessions),
        "num_subagents": len(result.subagents),
        "num_subagents_failed": sum(1 for s in result.subagents if s.end_s is None),
        "first_subagent_error": next((s.error for s in result.subagents if s.error), None),
        "cpu_busy_fraction": ratio(result.busy_s, result.makespan_s),
        "cpu_utilization": ratio(result.cpu_s, result.makespan_s * result.num_cpus) if result.cpu_s else None,
        "peak_device_kv_bytes": max((s.get("device_bytes", 0) for s in result.kv_samples), default=None),
        "peak_host_kv_bytes": max((s.get("host_bytes", 0) for s in result.kv_samples), default=None),
        **result.extra,
    }


class LoadPoint(NamedTuple):
    load_level: float
    sessions_per_hour: float | None
    jct_p99_s: float | None
    num_failed: int = 0


def goodput_at_slo(points: Sequence[LoadPoint], slo_jct_s: float) -> float:
    """Sessions per hour at the highest-throughput load that meets the SLO (p99 JCT <= slo, no failures); 0 if none.

    A load measured more than once (runs merged into one sweep) counts once: with the median of its runs'
    sessions per hour, and as meeting the SLO only if every run met it, so repeats do not pick the luckiest.

    NOTE: a load that misses the SLO counts for nothing, even if it completes more sessions: goodput is what a
    provider can sell at that latency promise.
    """
    by_load: dict[float, list[LoadPoint]] = {}
    for p in points:
        by_load.setdefault(p.load_level, []).append(p)
    ok = []
    for runs in by_load.values():
        if all(p.jct_p99_s is not None and p.sessions_per_hour is not None and p.jct_p99_s <= slo_jct_s
               and p.num_failed == 0 for p in runs):
            ok.append(percentile([p.sessions_per_hour for p in runs], 0.5))  # type: ignore[misc]
    return max(ok, default=0.0)


def default_slo_s(baseline: Sequence[LoadPoint], factor: float = 2.0) -> float | None:
    """`factor` x the p99 JCT of the baseline at its lightest load: "at most twice as slow as unloaded"."""
    usable = [p for p in baseline if p.jct_p99_s is not None]
    if not usable:
        return None
    return factor * min(usable, key=lambda p: p.load_level).jct_p99_s  # type: ignore[operator]


def cdf(values: Iterable[float]) -> tuple[list[float], list[float]]:
    """(sorted values, cumulative fractions) for a step plot."""
    s = sorted(values)
    return s, [(i + 1) / len(s) for i in range(len(s))]
