"""Timing for the kernel-sized benchmarks: the median of repeated calls after one warm-up."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def timed_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of `repeats` calls of `fn`, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)
