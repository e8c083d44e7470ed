"""Stated distributions: they pass through their published quantiles, and a seed fixes every draw."""

from __future__ import annotations

import random

import pytest

from sessionserve.workload.synth import (
    TRACELAB_TOOL_LATENCY_S,
    WEKA_STEPS_PER_SESSION,
    QuantileDist,
    num_steps,
    tool_wait_s,
)


def test_tool_latency_matches_tracelab_published_numbers() -> None:
    d = TRACELAB_TOOL_LATENCY_S
    assert d.quantile(0.5) == pytest.approx(0.129)  # Claude p50 ~129 ms
    assert d.quantile(0.61) == pytest.approx(1.0)  # ~61% of calls under 1 s
    assert d.quantile(0.96) == pytest.approx(60.0)  # ~4% over 1 min
    assert d.mean() == pytest.approx(16.8, abs=0.1)  # published mean effective latency
    assert 0.6 < d.share_above(60.0) < 0.9  # heavy tail: long calls hold most of the tool time
    assert "TraceLab" in d.describe()


def test_quantile_interpolates_log_linearly_and_validates() -> None:
    d = QuantileDist("x", ((0.0, 1.0), (1.0, 100.0)), "test")
    assert d.quantile(0.5) == pytest.approx(10.0)
    with pytest.raises(ValueError):
        QuantileDist("bad", ((0.1, 1.0), (1.0, 2.0)), "test")


def test_draws_are_fixed_by_the_seed_and_bounded() -> None:
    a = [tool_wait_s(random.Random("s"), time_scale=10, max_wait_s=5.0) for _ in range(3)]
    b = [tool_wait_s(random.Random("s"), time_scale=10, max_wait_s=5.0) for _ in range(3)]
    assert a == b
    rng = random.Random(1)
    waits = [tool_wait_s(rng, max_wait_s=5.0) for _ in range(2000)]
    assert max(waits) <= 5.0 and min(waits) >= 0.01
    steps = [num_steps(rng, max_steps=50) for _ in range(2000)]
    assert min(steps) >= 3 and max(steps) == 50
    assert WEKA_STEPS_PER_SESSION.quantile(0.5) == pytest.approx(45.0)
