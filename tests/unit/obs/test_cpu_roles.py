"""CPU roles: pools that meter their busy time, pinned to cores where the OS allows it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from sessionserve.obs.cpu_roles import CpuRoles, RoleMeter, RolePool, parse_cpus, pin_current_thread


def test_parse_cpus() -> None:
    assert parse_cpus(None) is None and parse_cpus("") is None
    assert parse_cpus("0-3,6") == frozenset({0, 1, 2, 3, 6})
    assert parse_cpus("1") == frozenset({1}) and parse_cpus([2, 0]) == frozenset({0, 2})
    for bad in ("a", "3-1", "1,", "-1", "0-x"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_busy_fraction_over_a_sliding_window() -> None:
    now = [100.0]
    meter = RoleMeter("tools", num_threads=2, window_s=10.0, clock=lambda: now[0])
    meter.record(5.0, cpu_s=1.0)
    meter.record(5.0, cpu_s=4.0)
    assert meter.busy_fraction() == pytest.approx(0.5) and meter.cpu_s == 5.0 and meter.num_tasks == 2
    now[0] = 111.0  # both fell out of the window; the totals stay
    assert meter.busy_fraction() == 0.0 and meter.busy_s == 10.0
    meter.record(30.0)  # longer than the window: counts as the window, never above 1
    assert meter.busy_fraction() == pytest.approx(0.5)
    with pytest.raises(ValueError):
        RoleMeter("x", 0)


def test_pool_meters_its_tasks_wall_and_cpu_time() -> None:
    pool = RolePool("tokenize", 2)
    try:
        def spin(s: float) -> int:  # s seconds of this thread's CPU, however busy the machine is
            t = time.thread_time()
            while time.thread_time() - t < s:
                pass
            return 7

        def sleep(s: float) -> int:
            time.sleep(s)
            return 8

        assert pool.submit(spin, 0.05).result() == 7 and pool.submit(sleep, 0.05).result() == 8
        meter = pool.meter
        assert meter.num_tasks == 2 and meter.busy_s >= 0.1
        assert 0.02 <= meter.cpu_s < meter.busy_s  # the sleep was busy (wall) but used no CPU
        roles = CpuRoles()
        roles.add(meter)
        snap = roles.snapshot()["tokenize"]
        assert snap["threads"] == 2 and snap["busy_fraction"] > 0
    finally:
        pool.shutdown()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two cores")
def test_pinned_pool_threads_and_their_processes_stay_on_their_cores() -> None:
    core = min(os.sched_getaffinity(0))
    pool = RolePool("tools", 1, frozenset({core}))
    try:
        assert pool.submit(lambda: os.sched_getaffinity(0)).result() == {core} and pool.pinned
        # A process a tool starts inherits the pin.
        out = pool.submit(subprocess.run, [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                          capture_output=True, text=True).result()
        assert out.stdout.strip() == f"[{core}]"
        assert os.sched_getaffinity(0) != {core}  # the caller is not pinned
    finally:
        pool.shutdown()
    assert pin_current_thread(None) is False and pin_current_thread(frozenset({10_000})) is False
