"""RetryBudget (sliding window, ratio and floor), Backoff, Retry-After parsing: pure, no clock."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessionserve.agent.retry import Backoff, RetryBudget, parse_retry_after_s, process_budget


def test_floor_allows_retries_before_any_request() -> None:
    budget = RetryBudget(ratio=0.1, min_retries_per_s=0.2, window_s=10)  # floor: 2 retries per window
    assert budget.try_acquire_retry(0.0) and budget.try_acquire_retry(0.1)
    assert not budget.try_acquire_retry(0.2)
    assert budget.num_retries == 2 and budget.num_denied == 1


def test_ratio_of_recent_requests_caps_retries() -> None:
    budget = RetryBudget(ratio=0.1, min_retries_per_s=0.0, window_s=10)
    for i in range(100):
        budget.record_request(i * 0.01)
    granted = sum(budget.try_acquire_retry(1.0) for _ in range(50))
    assert granted == 10
    assert budget.max_retries(1.0) == pytest.approx(10)


def test_window_slides_requests_and_retries_out() -> None:
    budget = RetryBudget(ratio=0.5, min_retries_per_s=0.0, window_s=1.0)
    for _ in range(4):
        budget.record_request(0.0)
    assert budget.try_acquire_retry(0.5) and budget.try_acquire_retry(0.5)
    assert not budget.can_retry(0.6)
    assert not budget.can_retry(1.2)  # the requests left the window: no allowance at all
    for _ in range(2):
        budget.record_request(1.3)
    assert budget.can_retry(1.6)  # the old retries left too: 1 allowed out of 0.5 * 2


def test_unlimited_budget_never_denies() -> None:
    budget = RetryBudget.unlimited()
    assert all(budget.try_acquire_retry(0.0) for _ in range(1000))
    assert math.isinf(budget.max_retries(0.0))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.floats(0, 0.5)), max_size=300), st.floats(0.05, 0.5))
def test_retries_never_exceed_ratio_of_requests_plus_floor(ops: list[tuple[bool, float]], ratio: float) -> None:
    """Property: when a retry is granted, retries in the window (it included) <= max(floor, ratio * requests).

    (Later, requests can slide out of the window before the retries they paid for do.)
    """
    window_s, floor = 5.0, 1.0
    budget = RetryBudget(ratio=ratio, min_retries_per_s=floor / window_s, window_s=window_s)
    now, requests, retries = 0.0, [], []
    for is_retry, dt in ops:
        now += dt
        if not is_retry:
            budget.record_request(now)
            requests.append(now)
        elif budget.try_acquire_retry(now):
            retries.append(now)
            in_window = [t for t in requests if t > now - window_s]
            assert sum(1 for t in retries if t > now - window_s) <= max(floor, ratio * len(in_window)) + 1e-9


def test_invalid_budget() -> None:
    with pytest.raises(ValueError):
        RetryBudget(window_s=0)


def test_process_budget_is_one_object() -> None:
    assert process_budget() is process_budget()


def test_backoff_grows_with_jitter_and_is_capped() -> None:
    backoff = Backoff(base_s=0.1, multiplier=2.0, max_s=0.3, max_attempts=5)
    rng = random.Random(0)
    for num_failed, cap in [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.3)]:
        delays = [backoff.delay_s(num_failed, rng) for _ in range(200)]
        assert all(0 <= d <= cap for d in delays)
        assert max(delays) > 0.8 * cap and min(delays) < 0.2 * cap  # jittered over the whole range
    assert backoff.delay_s(5, rng) is None  # max_attempts includes the first


def test_backoff_honours_retry_after_as_a_floor_and_gives_up_past_the_limit() -> None:
    backoff = Backoff(base_s=0.01, max_retry_after_s=10.0)
    rng = random.Random(0)
    assert backoff.delay_s(1, rng, retry_after_s=2.0) == 2.0
    assert backoff.delay_s(1, rng, retry_after_s=60.0) is None


def test_parse_retry_after() -> None:
    assert parse_retry_after_s({"Retry-After": "3"}) == 3.0
    assert parse_retry_after_s({"retry-after": "0.25"}) == 0.25
    assert parse_retry_after_s({"retry-after-ms": "150", "Retry-After": "9"}) == 0.15
    assert parse_retry_after_s({"Retry-After": "Wed, 21 Oct 2015 07:28:10 GMT"}, now_epoch_s=1445412480) == 10.0
    assert parse_retry_after_s({"Retry-After": "soon"}) is None
    assert parse_retry_after_s({}) is None and parse_retry_after_s(None) is None
