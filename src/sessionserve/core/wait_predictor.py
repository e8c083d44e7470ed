"""Predicts how long a parked session will wait, from waits observed per tool.

Learned online: each tool name keeps a bounded window of its recent observed
waits; a prediction for a step that called several tools concurrently is the
maximum of their quantiles (the step resumes when the slowest returns). With
no history for a tool, the global window is used; with none at all, a prior.
Pure: no clock; observations carry their own durations.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import NamedTuple


class WaitPrediction(NamedTuple):
    p10_s: float
    p50_s: float
    p90_s: float
    num_samples: int


class _Window:
    """The last `size` samples, also kept sorted for O(log n) quantiles."""

    __slots__ = ("_fifo", "_sorted", "_size")

    def __init__(self, size: int) -> None:
        self._fifo: deque[float] = deque()
        self._sorted: list[float] = []
        self._size = size

    def add(self, value: float) -> None:
        if len(self._fifo) == self._size:
            old = self._fifo.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._fifo.append(value)
        bisect.insort(self._sorted, value)

    def quantile(self, q: float) -> float:
        s = self._sorted
        return s[min(len(s) - 1, int(q * len(s)))]

    def __len__(self) -> int:
        return len(self._fifo)


class WaitPredictor:
    """Per-tool quantiles of observed waits, in seconds."""

    def __init__(self, window: int = 256, prior_wait_s: float = 5.0, min_samples: int = 3) -> None:
        self.window = window
        self.prior_wait_s = prior_wait_s
        self.min_samples = min_samples
        self._by_tool: dict[str, _Window] = {}
        self._all = _Window(window * 4)
        # NOTE: predict() runs for parked sessions on engine ticks; its answer changes only when a wait is
        # observed for one of its tools (or, answered from the global window, for any tool), so it is
        # memoized per (tools, hint) until then, with whether it read the global window.
        self._memo: dict[tuple[tuple[str, ...], float | None], tuple[WaitPrediction, bool]] = {}
        self.num_observed = 0  # predictions can change only when this does

    def clear_memo(self) -> None:
        """Forget the memoized predictions (bounded at 4,096; they are worked out again when asked)."""
        self._memo.clear()

    def observe(self, tools: tuple[str, ...], wait_s: float) -> None:
        """Record that a park after calling `tools` lasted `wait_s`."""
        wait_s = max(0.0, float(wait_s))
        seen = set(tools or ("",))
        for key in [k for k, (_, is_global) in self._memo.items() if is_global or not seen.isdisjoint(k[0] or ("",))]:
            del self._memo[key]
        self.num_observed += 1
        for tool in tools or ("",):
            self._by_tool.setdefault(tool, _Window(self.window)).add(wait_s)
        self._all.add(wait_s)

    def overall(self) -> WaitPrediction | None:
        """Quantiles of every wait observed, whatever the tools; None before `min_samples` waits."""
        w = self._all
        if len(w) < self.min_samples:
            return None
        return WaitPrediction(w.quantile(0.10), w.quantile(0.50), w.quantile(0.90), len(w))

    def predict(self, tools: tuple[str, ...], hint_s: float | None = None) -> WaitPrediction:
        """Quantiles of the wait after calling `tools`. A client hint, when given, sets the median."""
        key = (tools, hint_s)
        hit = self._memo.get(key)
        if hit is None:
            if len(self._memo) >= 4096:  # (hints are free floats: keys need not repeat)
                self._memo.clear()
            hit = self._memo[key] = self._predict(tools, hint_s)
        return hit[0]

    def _predict(self, tools: tuple[str, ...], hint_s: float | None) -> tuple[WaitPrediction, bool]:
        """The prediction, and whether it came from the global window (or the prior) rather than the tools'."""
        windows = [self._by_tool.get(t) for t in (tools or ("",))]
        known = [w for w in windows if w is not None and len(w) >= self.min_samples]
        if known:
            p10 = max(w.quantile(0.10) for w in known)
            p50 = max(w.quantile(0.50) for w in known)
            p90 = max(w.quantile(0.90) for w in known)
            n = min(len(w) for w in known)
        elif (everything := self.overall()) is not None:
            p10, p50, p90, n = everything.p10_s, everything.p50_s, everything.p90_s, 0
        else:
            p10, p50, p90, n = self.prior_wait_s / 4, self.prior_wait_s, self.prior_wait_s * 4, 0
        if hint_s is not None:
            scale = hint_s / p50 if p50 > 0 else 1.0
            p10, p50, p90 = p10 * scale, hint_s, max(p90 * scale, hint_s)
        return WaitPrediction(p10, p50, p90, n), not known
