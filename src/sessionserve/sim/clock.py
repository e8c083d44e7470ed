"""The virtual clock: simulated seconds that move only when the simulator moves them."""

from __future__ import annotations


class VirtualClock:
    """A zero-argument callable returning simulated seconds, as `EngineCore` expects of a clock.

    Invariant: time never goes backwards; `advance_to` an earlier time is a no-op.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot advance by a negative time ({seconds})")
        self.now_s += seconds

    def advance_to(self, t_s: float) -> None:
        self.now_s = max(self.now_s, t_s)
