"""LatencyEstimator: EWMA per tool and per step, and the wait announced before tools are known."""

from __future__ import annotations

import pytest

from sessionserve.agent.latency import LatencyEstimator


def test_learns_per_tool_and_tracks_changes() -> None:
    est = LatencyEstimator(alpha=0.5)
    assert est.estimate_s("grep") is None
    est.observe("grep", 1.0)
    assert est.estimate_s("grep") == 1.0
    for _ in range(20):
        est.observe("grep", 3.0)
    assert est.estimate_s("grep") == pytest.approx(3.0, abs=1e-3)


def test_deviation_widens_the_estimate_when_asked() -> None:
    est = LatencyEstimator(alpha=0.5, num_devs=2.0)
    for x in (1.0, 3.0, 1.0, 3.0):
        est.observe("t", x)
    stat_mean = LatencyEstimator(alpha=0.5)
    for x in (1.0, 3.0, 1.0, 3.0):
        stat_mean.observe("t", x)
    assert est.estimate_s("t") > stat_mean.estimate_s("t") + 1.0


def test_expected_wait_prefers_named_tool_then_steps_then_offered_tools() -> None:
    est = LatencyEstimator(alpha=1.0)
    assert est.expected_wait_s(["a", "b"]) is None
    est.observe("a", 1.0)
    est.observe("b", 3.0)
    assert est.expected_wait_s(["a", "b", "c"]) == 2.0  # mean over the known offered tools
    est.observe_step(2.5)
    assert est.expected_wait_s(["a", "b"]) == 2.5
    assert est.expected_wait_s(["a", "b"], named="b") == 3.0
    assert est.expected_wait_s(["a"], named="unknown") == 2.5
