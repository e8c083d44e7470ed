"""CircuitBreaker: opens after consecutive failures, probes once after the pause, closes on success."""

from __future__ import annotations

from sessionserve.agent.breaker import BreakerConfig, BreakerState, CircuitBreaker


def test_opens_after_threshold_and_refuses_until_the_pause_ends() -> None:
    b = CircuitBreaker(BreakerConfig(failure_threshold=3, open_s=1.0))
    for t in range(2):
        assert b.allow(t)
        b.record_failure(t)
    assert b.state is BreakerState.CLOSED
    b.record_success(2)  # a success resets the count
    for t in (3, 4, 5):
        b.record_failure(t)
    assert b.state is BreakerState.OPEN
    assert not b.allow(5.5)


def test_half_open_lets_one_probe_through() -> None:
    b = CircuitBreaker(BreakerConfig(failure_threshold=1, open_s=1.0))
    b.record_failure(0.0)
    assert b.allow(1.0) and b.state is BreakerState.HALF_OPEN
    assert not b.allow(1.0)  # the probe is in flight
    b.record_failure(1.1)  # the probe failed: open again, for a full pause
    assert b.state is BreakerState.OPEN and not b.allow(1.5)
    assert b.allow(2.2)
    b.record_success(2.3)
    assert b.state is BreakerState.CLOSED and b.allow(2.3) and b.allow(2.3)
