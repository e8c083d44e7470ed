"""Metrics math on hand-made replay records: percentiles, summaries, goodput at an SLO, results and report text."""

from __future__ import annotations

import numpy as np
import pytest

from sessionserve.workload.backend import StepResult
from sessionserve.workload.metrics import (LoadPoint, default_slo_s, goodput_at_slo, percentile, rate_between,
                                           summarize, sustained_rate_per_hour, sustained_window,
                                           sustained_window_of)
from sessionserve.workload.replay import LoadSpec, ReplayResult, SessionRecord, StepRecord
from sessionserve.workload.report import render_markdown
from sessionserve.workload.results import build_results
from sessionserve.workload.trace import AgentSession, Step, TraceSet


def test_percentile_matches_numpy_linear() -> None:
    xs = [5.0, 1.0, 9.0, 3.0, 7.5, 2.0]
    for q in (0.0, 0.25, 0.5, 0.9, 0.99, 1.0):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, 100 * q)))
    assert percentile([], 0.5) is None


def test_goodput_is_best_throughput_meeting_the_slo() -> None:
    points = [LoadPoint(2, 100.0, 10.0), LoadPoint(4, 180.0, 19.0), LoadPoint(8, 250.0, 31.0),
              LoadPoint(16, 260.0, 12.0, num_failed=1)]
    assert goodput_at_slo(points, 20.0) == 180.0
    assert goodput_at_slo(points, 5.0) == 0.0
    assert default_slo_s(points, 2.0) == 20.0  # 2 x p99 JCT at the lightest load


def test_goodput_takes_a_repeated_load_at_its_median_and_only_if_every_run_meets_the_slo() -> None:
    points = [LoadPoint(2, 100.0, 10.0), LoadPoint(4, 180.0, 15.0), LoadPoint(4, 240.0, 12.0),
              LoadPoint(8, 400.0, 12.0), LoadPoint(8, 420.0, 25.0)]
    assert goodput_at_slo(points, 20.0) == pytest.approx(210.0)  # load 4: median of 180 and 240; load 8 missed once
    assert goodput_at_slo(points, 30.0) == pytest.approx(410.0)


def run(jcts: list[float], recompute: int, load: int, hits: int = 0, misses: int = 0) -> ReplayResult:
    sessions = [SessionRecord(f"s{i}", 0.0, 0.0, j, 2, 0.5,
                              stats={"num_recompute_tokens": recompute / len(jcts), "num_prefetch_hits": hits,
                                     "num_prefetch_late": 0, "num_restore_misses": misses})
                for i, j in enumerate(jcts)]
    steps = [StepRecord(s.session_id, 0, 0.0, 10, StepResult([1, 2], 0.2, 0.05, 0.01, 100, 60)) for s in sessions]
    return ReplayResult(LoadSpec("closed", load), sessions, steps, [{"t_s": 0.0, "device_bytes": 1 << 20}],
                        makespan_s=max(jcts), busy_s=0.5 * max(jcts), cpu_s=None)


def test_summarize_counts_rates_and_fractions() -> None:
    s = summarize(run([1.0, 2.0, 3.0, 4.0], recompute=40, load=2, hits=1, misses=1))
    assert s["num_completed"] == 4 and s["sessions_per_hour"] == pytest.approx(3600.0)
    assert summarize(run([1.0, 2.0], recompute=0, load=2))["sessions_per_hour_sustained"] is None  # no queue
    assert s["jct_p50_s"] == pytest.approx(2.5) and s["recompute_tokens"] == pytest.approx(40)
    assert s["prefetch_hit_rate"] == pytest.approx(0.5)  # 4 hits / (4 hits + 4 misses)
    assert s["cached_fraction"] == pytest.approx(0.6) and s["cpu_busy_fraction"] == pytest.approx(0.5)
    failed = run([1.0, 2.0], recompute=0, load=2)
    failed.sessions[1].end_s = None
    assert summarize(failed)["num_failed"] == 1


def test_sustained_rate_counts_only_the_full_load_window() -> None:
    # Two agents. A: [0, 2] [2, 5] [5, 6]; B: [0, 3] [3, 4] [4, 9]. The last start is at 5; after it B's last
    # session runs alone (the drain). Inside (2, 5]: completions at 3, 4, 5 -> 3 per 3 s.
    starts = [0.0, 0.0, 2.0, 3.0, 4.0, 5.0]
    ends: list[float | None] = [2.0, 3.0, 5.0, 4.0, 9.0, 6.0]
    assert sustained_rate_per_hour(starts, ends, agents=2) == pytest.approx(3600.0)
    ends[3] = None  # a failed session takes its agent's time and is not counted
    assert sustained_rate_per_hour(starts, ends, agents=2) == pytest.approx(3600 * 2 / 3)
    assert sustained_rate_per_hour(starts[:2], ends[:2], agents=2) is None  # every session started at once
    assert sustained_rate_per_hour([0.0, 0.0, 2.0], [2.0, 3.0, 4.0], agents=2) is None  # the window is one instant
    assert sustained_window(starts, ends, agents=2) == (2.0, 5.0)
    assert sustained_window(starts[:2], ends[:2], agents=2) is None
    closed = run([1.0, 2.0, 3.0, 4.0], recompute=0, load=2)
    for rec, (a, b) in zip(closed.sessions, [(0, 1), (0, 2), (1, 4), (2, 3)]):
        rec.arrival_s = rec.start_s = float(a)
        rec.end_s = float(b)
    assert summarize(closed)["sessions_per_hour_sustained"] == pytest.approx(3600.0)  # 1 and 2 inside (1, 2]
    assert sustained_window_of(closed) == (1.0, 2.0)
    assert sustained_rate_per_hour([0.0] * 3, [1.0] * 3, agents=2) is None


def test_results_ratios_to_baseline_and_report_states_scales() -> None:
    trace = TraceSet("t", (AgentSession("s", (Step(1, 1, (), "end"),)),), 128.0, 10.0, ("from a test",))
    runs = {"discard": [run([2.0, 2.0], 100, 1), run([5.0] * 4, 200, 2)],
            "keep": [run([2.0, 2.0], 0, 1), run([3.0] * 4, 0, 2)]}
    res = build_results(trace, runs, meta={"command": "sessionserve bench", "settings": {"mode": "closed"}})
    assert res["slo_jct_p99_s"] == pytest.approx(4.0)  # 2 x discard's p99 at the lightest load
    assert res["policies"]["keep"]["sessions_per_hour_at_slo"] == pytest.approx(3600 * 4 / 3)  # heavier load meets
    assert res["policies"]["discard"]["sessions_per_hour_at_slo"] == pytest.approx(3600)  # only the light load
    assert res["policies"]["keep"]["vs_baseline"]["sessions_per_hour_at_slo"] == pytest.approx(4 / 3)
    assert res["policies"]["keep"]["vs_baseline"]["jct_p99_s"] == pytest.approx(0.6)
    assert res["reference_load"] == "2 agents"
    md = render_markdown(res)
    assert "token counts / 128, times / 10" in md and "from a test" in md and "sessionserve bench" in md


def test_a_sampled_counters_rate_is_read_between_samples() -> None:
    # CPU seconds read at 0, 1, 3 s: 2 cores busy for the first second, 0.5 for the next two.
    samples = [(0.0, 10.0), (1.0, 12.0), (3.0, 13.0)]
    assert rate_between(samples, 0.0, 1.0) == pytest.approx(2.0)
    assert rate_between(samples, 0.5, 2.0) == pytest.approx((12.5 - 11.0) / 1.5)  # read linearly inside
    assert rate_between(samples, 0.0, 3.0) == pytest.approx(1.0)
    assert rate_between(samples, 0.0, 4.0) is None  # past the last sample
    assert rate_between(samples, 2.0, 2.0) is None
    assert rate_between([], 0.0, 1.0) is None
