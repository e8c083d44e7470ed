"""The benchmark's server-process helpers that need no server: sampling a counter while a block runs."""

from __future__ import annotations

import itertools
import time

from sessionserve.workload.server_process import sampled


def test_sampled_reads_the_counter_while_the_block_runs_and_once_after() -> None:
    counter = itertools.count()
    with sampled(lambda: float(next(counter)), interval_s=0.01) as samples:
        time.sleep(0.1)
        inside = len(samples)
    assert inside >= 2  # the first read at once, more every interval
    assert len(samples) > inside  # the read at the end
    times = [t for t, _ in samples]
    assert times == sorted(times) and times[0] < 0.05 and times[-1] >= 0.1
    assert [v for _, v in samples] == list(map(float, range(len(samples))))  # every read kept, in order
