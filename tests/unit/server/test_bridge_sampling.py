"""The engine thread reads the gauges on a timer, not after every step, and once more as the work stops."""

from __future__ import annotations

import time
from types import SimpleNamespace

from sessionserve.server.bridge import AsyncEngine


class _Engine:
    """Steps that take 2 ms and have work for the first `num_busy` of them."""

    def __init__(self, num_busy: int) -> None:
        self.num_busy = num_busy
        self.num_steps = 0
        self.core = SimpleNamespace(scheduler=SimpleNamespace(running=[]))

    def has_unfinished(self) -> bool:
        return self.num_steps < self.num_busy

    def step(self) -> list:
        self.num_steps += 1
        time.sleep(0.002)
        busy = self.num_steps <= self.num_busy
        return [SimpleNamespace(request_id="r", finished=False, error=None)] if busy else []


def test_gauges_are_read_on_a_timer_while_busy_and_once_as_the_steps_stop() -> None:
    eng = _Engine(num_busy=100)
    steps: list[int] = []
    gauges: list[int] = []  # the step count each time the gauges were read
    bridge = AsyncEngine(eng, on_step=lambda e, dt, cpu: steps.append(e.num_steps),  # type: ignore[arg-type]
                         on_gauges=lambda e: gauges.append(e.num_steps), idle_tick_s=0.01, idle_sample_s=60.0,
                         busy_sample_s=0.05)
    bridge.start()
    try:
        deadline = time.monotonic() + 10
        while not (eng.num_steps > 100 and gauges and gauges[-1] > 100) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        bridge._stop.set()
        bridge._thread.join(5)
    assert len(steps) >= 100  # the step time: every step with work
    busy_reads = [n for n in gauges if n <= 100]
    assert 1 <= len(busy_reads) <= 10, gauges  # ~0.2 s of steps at one read per 0.05 s, not 100
    assert gauges[-1] > 100 and len([n for n in gauges if n > 100]) == 1, gauges  # once as the work stopped
