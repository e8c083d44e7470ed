"""A circuit breaker per tool: stop calling a dependency that keeps failing, probe it after a pause.

CLOSED counts consecutive failures; at `failure_threshold` it opens. OPEN
refuses every call for `open_s`, then lets one probe through (HALF_OPEN); the
probe's success closes the breaker, its failure opens it again. Pure: the
caller passes `now`.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    failure_threshold: int = 5  # consecutive failures that open the breaker
    open_s: float = 5.0  # how long an open breaker refuses calls before a probe

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or self.open_s < 0:
            raise ValueError(f"invalid breaker config {self}")


class CircuitBreaker:
    """Consecutive-failure breaker. `allow(now)` before a call; `record_success/failure(now)` after it."""

    def __init__(self, config: BreakerConfig | None = None) -> None:
        self.config = config or BreakerConfig()
        self.state = BreakerState.CLOSED
        self.num_consecutive_failures = 0
        self.opened_s: float | None = None
        self._is_probing = False
        self._lock = threading.Lock()

    def allow(self, now: float) -> bool:
        """Whether a call may go out now. In HALF_OPEN only one probe is in flight at a time."""
        with self._lock:
            if self.state is BreakerState.OPEN:
                assert self.opened_s is not None
                if now - self.opened_s < self.config.open_s:
                    return False
                self.state = BreakerState.HALF_OPEN
                self._is_probing = False
            if self.state is BreakerState.HALF_OPEN:
                if self._is_probing:
                    return False
                self._is_probing = True
            return True

    def record_success(self, now: float) -> None:
        with self._lock:
            self.state = BreakerState.CLOSED
            self.num_consecutive_failures = 0
            self.opened_s = None
            self._is_probing = False

    def record_failure(self, now: float) -> None:
        with self._lock:
            self.num_consecutive_failures += 1
            if self.state is BreakerState.HALF_OPEN or self.num_consecutive_failures >= self.config.failure_threshold:
                self.state = BreakerState.OPEN
                self.opened_s = now
                self._is_probing = False
