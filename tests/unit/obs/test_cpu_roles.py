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


_POOLS_SCRIPT = r"""
import json, os, queue, sys, threading
import torch
from sessionserve.obs.cpu_roles import _gnu_openmp, release_compute_threads
from sessionserve.server.bridge import AsyncEngine

def switches():  # voluntary context switches of every thread in the process
    total = 0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            total += next(int(l.split()[1]) for l in f if l.startswith("voluntary_ctxt_switches"))
    return total

def ops(n):  # n parallel regions back to back, as a model step runs them
    x = torch.ones(1 << 20)
    before = switches()
    for _ in range(n):
        x.mul_(1.0)
    return switches() - before

torch.set_num_threads(2)
ops(1)  # the main thread's pool (a model loaded here)
jobs, done = queue.Queue(), queue.Queue()
threading.Thread(target=lambda: [done.put(ops(jobs.get())) for _ in range(3)], daemon=True).start()
jobs.put(1); done.get()  # the stepping thread's pool
threads = len(os.listdir("/proc/self/task"))
jobs.put(400); both = done.get()
if sys.argv[1] == "bridge":  # handing an engine to the server's bridge lets the pool go
    AsyncEngine(object())  # type: ignore[arg-type]
    released = _gnu_openmp() is not None
else:
    released = release_compute_threads()
jobs.put(400); alone = done.get()
print(json.dumps({"released": released, "threads": [threads, len(os.listdir("/proc/self/task"))],
                  "switches": [both, alone]}))
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2 or not sys.platform.startswith("linux"), reason="needs 2 CPUs, Linux")
@pytest.mark.parametrize("how", ["direct", "bridge"])
def test_letting_the_loading_threads_pool_go_lets_the_stepping_threads_spin(how: str) -> None:
    """Two threads' OpenMP pools on 2 CPUs: the stepping thread's workers sleep after every region;
    once the loading thread's pool goes (by itself, or as the server's bridge takes the engine), they spin
    between regions instead of sleeping."""
    out = subprocess.run([sys.executable, "-c", _POOLS_SCRIPT, how], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    facts = __import__("json").loads(out.stdout)
    if not facts["released"]:
        pytest.skip("torch here does not run on GNU OpenMP")
    (before, after), (both, alone) = facts["threads"], facts["switches"]
    assert after < before  # the loading thread's worker went
    assert both >= 200  # 400 regions: the workers slept after most of them
    assert alone < both / 4
