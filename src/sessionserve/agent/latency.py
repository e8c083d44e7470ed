"""Per-tool latency learned online, and the wait a parked session should announce.

The server parks a session while its tools run and uses the client's
`expected_wait_s` to decide whether to offload the KV and when to prefetch
it back. The runtime knows best how long its tools take: it keeps an
exponentially weighted mean and mean deviation per tool (as TCP does for
round-trip times) and of whole tool phases per step. Pure: no clock; the
caller reports durations.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class _Ewma:
    mean_s: float
    dev_s: float = 0.0
    num_samples: int = 1

    def update(self, x_s: float, alpha: float) -> None:
        self.dev_s = (1 - alpha) * self.dev_s + alpha * abs(x_s - self.mean_s)
        self.mean_s = (1 - alpha) * self.mean_s + alpha * x_s
        self.num_samples += 1


class LatencyEstimator:
    """EWMA of each tool's duration and of each step's tool phase (its critical path).

    `estimate_s` = mean + `num_devs` * mean deviation: a little late is
    cheaper than early for a prefetch, so the default leans to the mean.
    """

    def __init__(self, alpha: float = 0.3, num_devs: float = 0.0) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.num_devs = num_devs
        self._tools: dict[str, _Ewma] = {}
        self._step: _Ewma | None = None

    def observe(self, tool: str, duration_s: float) -> None:
        """One finished call of `tool` took `duration_s` (successful or not: the session waited either way)."""
        stat = self._tools.get(tool)
        if stat is None:
            self._tools[tool] = _Ewma(duration_s)
        else:
            stat.update(duration_s, self.alpha)

    def observe_step(self, wait_s: float) -> None:
        """One step's tool phase (first tool start to last tool end) took `wait_s`."""
        if self._step is None:
            self._step = _Ewma(wait_s)
        else:
            self._step.update(wait_s, self.alpha)

    def estimate_s(self, tool: str) -> float | None:
        stat = self._tools.get(tool)
        return None if stat is None else stat.mean_s + self.num_devs * stat.dev_s

    def expected_wait_s(self, candidates: Iterable[str] = (), named: str | None = None) -> float | None:
        """What to announce before the model picks tools: None when nothing was learned yet.

        NOTE: the hint rides on the request whose reply holds the tool calls, so
        it is sent before the tools are known. A named tool_choice pins the
        tool; otherwise the recent step phases are the best guess; failing
        that, the mean over the tools offered.
        """
        if named is not None and named in self._tools:
            return self.estimate_s(named)
        if self._step is not None:
            return self._step.mean_s + self.num_devs * self._step.dev_s
        known = [e for t in candidates if (e := self.estimate_s(t)) is not None]
        return sum(known) / len(known) if known else None
