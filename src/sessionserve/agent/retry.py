"""One retry budget for the whole process, exponential backoff with jitter, and Retry-After parsing.

A failing dependency must not be amplified by stacked retries: three HTTP
retries under three re-plans is nine times the load on the thing that is
already failing. So every layer (model HTTP calls, tool calls, re-plans
after a tool failure) asks the same `RetryBudget` before it retries. The
budget follows Finagle's and Envoy's retry budgets: over a sliding window, a
retry is allowed only if, counting it, retries <= max(min_retries_per_s *
window_s, ratio * requests). Requests are logical calls (first attempts); retries are
everything else. With ratio 0.1 a process sends at most ~1.1x the attempts
it would send with no failures, once the window holds more than
min_retries_per_s * window_s / ratio requests.

The budget and the backoff are pure: they take `now` (seconds, any monotonic
clock) and a `random.Random`; nothing here sleeps or reads a clock.
"""

from __future__ import annotations

import email.utils
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass


class RetryBudget:
    """Sliding-window retry budget shared by every layer of a process.

    `record_request(now)` for each logical call; `try_acquire_retry(now)`
    before each retry (True: go ahead, the retry is recorded; False: don't
    retry). Thread-safe: agents on several event loops or threads may share
    one budget.
    """

    def __init__(self, ratio: float = 0.1, min_retries_per_s: float = 0.5, window_s: float = 10.0) -> None:
        if ratio < 0 or min_retries_per_s < 0 or window_s <= 0:
            raise ValueError("ratio and min_retries_per_s must be >= 0 and window_s > 0")
        self.ratio = ratio
        self.min_retries_per_s = min_retries_per_s
        self.window_s = window_s
        self._requests: deque[float] = deque()
        self._retries: deque[float] = deque()
        self._lock = threading.Lock()
        # Lifetime totals, for benchmarks and tests.
        self.num_requests = 0
        self.num_retries = 0
        self.num_denied = 0

    @classmethod
    def unlimited(cls) -> RetryBudget:
        """A budget that never says no: the naive baseline (every layer retries on its own)."""
        return cls(ratio=math.inf)

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        for q in (self._requests, self._retries):
            while q and q[0] <= horizon:
                q.popleft()

    def max_retries(self, now: float) -> float:
        """Retries the window allows right now (not counting those already spent)."""
        with self._lock:
            self._prune(now)
            return self._allowance()

    def _allowance(self) -> float:
        if math.isinf(self.ratio):
            return math.inf
        return max(self.min_retries_per_s * self.window_s, self.ratio * len(self._requests))

    def record_request(self, now: float) -> None:
        """A logical call (a first attempt) started."""
        with self._lock:
            self._prune(now)
            self._requests.append(now)
            self.num_requests += 1

    def can_retry(self, now: float) -> bool:
        """Whether a retry would be allowed now; records nothing."""
        with self._lock:
            self._prune(now)
            return len(self._retries) + 1 <= self._allowance()

    def try_acquire_retry(self, now: float) -> bool:
        """Spend one retry if the window allows it. Records the retry on success."""
        with self._lock:
            self._prune(now)
            if len(self._retries) + 1 <= self._allowance():
                self._retries.append(now)
                self.num_retries += 1
                return True
            self.num_denied += 1
            return False


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter, capped; honours a server's Retry-After.

    `max_attempts` counts the first attempt (3 = up to two retries).
    """

    base_s: float = 0.1  # first retry waits up to this long
    multiplier: float = 2.0
    max_s: float = 5.0  # cap for one wait
    max_attempts: int = 3
    max_retry_after_s: float = 30.0  # a server asking for a longer wait than this is not retried

    def __post_init__(self) -> None:
        if self.base_s < 0 or self.multiplier < 1 or self.max_s < 0 or self.max_attempts < 1:
            raise ValueError(f"invalid backoff {self}")

    def delay_s(self, num_failed: int, rng: random.Random, retry_after_s: float | None = None) -> float | None:
        """Wait before the next attempt after `num_failed` failed ones, or None: don't retry.

        NOTE: full jitter (uniform in [0, cap]) spreads a burst of clients that
        failed together; a Retry-After from the server is a floor, not a hint.
        """
        if num_failed >= self.max_attempts:
            return None
        if retry_after_s is not None and retry_after_s > self.max_retry_after_s:
            return None
        cap_s = min(self.max_s, self.base_s * self.multiplier ** (num_failed - 1))
        delay_s = rng.uniform(0.0, cap_s)
        return max(delay_s, retry_after_s) if retry_after_s is not None else delay_s


def parse_retry_after_s(headers: dict[str, str] | None, now_epoch_s: float | None = None) -> float | None:
    """Seconds to wait from `retry-after-ms` or `Retry-After` (seconds or an HTTP date); None if absent/bad."""
    if not headers:
        return None
    lower = {k.lower(): v for k, v in headers.items()}
    ms = lower.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    value = lower.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    now_epoch_s = time.time() if now_epoch_s is None else now_epoch_s
    return max(0.0, when.timestamp() - now_epoch_s)


_PROCESS_BUDGET: RetryBudget | None = None
_PROCESS_LOCK = threading.Lock()


def process_budget() -> RetryBudget:
    """The process-wide budget that agents and clients share unless given their own.

    NOTE: one object per process is the point: a budget per layer is how 3 x 3
    retries happen.
    """
    global _PROCESS_BUDGET
    with _PROCESS_LOCK:
        if _PROCESS_BUDGET is None:
            _PROCESS_BUDGET = RetryBudget()
        return _PROCESS_BUDGET
