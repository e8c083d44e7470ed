"""CPU roles: tokenization, the engine loop and tool execution, each on its own threads (and cores).

On an agent server the CPU is on the critical path three ways: it tokenizes
and renders prompts, it runs the engine loop that feeds the accelerator, and
it runs the agents' tools (tests, builds, searches). If they share threads
and cores, a burst of tool work stretches every engine step. Each role here
gets its own pool (`RolePool`), sized from the config, optionally pinned to a
set of cores (`os.sched_setaffinity` on the pool's threads, which processes
they start inherit), and metered: busy seconds (wall time inside the role's
tasks), CPU seconds, and the busy fraction over a sliding window.

The engine loop is one thread, not a pool: `RoleMeter` meters it directly
(`record(busy_s)` after each step) and `pin_current_thread` pins it.

The model's operators run on OpenMP threads, and GNU OpenMP (what PyTorch's
Linux wheels ship) keeps a pool of them for every thread that ever ran a
parallel region. Once the process holds more pool threads than it has CPUs,
every pool's threads stop spinning between regions and sleep: each of the
~140 operators of a decode step then waits for a futex wake. A model loaded
on the main thread and stepped on the engine thread is that case on 2 cores
(28,000 context switches in 200 steps instead of 500; a step of one
sequence 20-25% slower). `release_compute_threads` lets the calling thread's
pool go; the thread that built an engine calls it when it hands the engine
to the thread that steps it, and a helper thread (the KV mover) each time
it runs out of jobs.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

TOKENIZE, ENGINE, TOOLS = "tokenize", "engine", "tools"


def parse_cpus(spec: str | Iterable[int] | None) -> frozenset[int] | None:
    """'0-3,6' -> {0, 1, 2, 3, 6}; None or '' -> None (no pinning). Raises ValueError on a bad spec."""
    if spec is None or spec == "":
        return None
    if not isinstance(spec, str):
        cpus = frozenset(int(c) for c in spec)
    else:
        cpus = set()
        for part in spec.split(","):
            lo, sep, hi = part.strip().partition("-")
            if not lo.isdigit() or (sep and not hi.isdigit()):
                raise ValueError(f"bad CPU list {spec!r}: use e.g. '0-3,6'")
            first, last = int(lo), int(hi) if sep else int(lo)
            if last < first:
                raise ValueError(f"bad CPU range {part!r} in {spec!r}")
            cpus.update(range(first, last + 1))
        cpus = frozenset(cpus)
    if not cpus or min(cpus) < 0:
        raise ValueError(f"bad CPU list {spec!r}")
    return cpus


def pin_current_thread(cpus: frozenset[int] | None) -> bool:
    """Pin the calling thread (and processes it starts later) to `cpus`; False where the OS does not allow it."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        allowed = os.sched_getaffinity(0)
        usable = cpus & allowed
        if not usable:
            return False
        os.sched_setaffinity(0, usable)  # 0: the calling thread on Linux
        return True
    except OSError:
        return False


_openmp: list[ctypes.CDLL] = []  # GNU OpenMP once found


def _gnu_openmp() -> ctypes.CDLL | None:
    """GNU OpenMP as loaded in this process (by torch), or None where another runtime or none is (yet)."""
    if _openmp:
        return _openmp[0]
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
        except (OSError, AttributeError):
            continue
        _openmp.append(lib)
        return lib
    return None


def release_compute_threads() -> bool:
    """Let go of the OpenMP threads the calling thread started (its next parallel region starts them again).

    Call it on a thread that is done with compute for a while: the one that loaded a model another thread
    will step, a helper between jobs. True where GNU OpenMP took the call (with or without a pool to let
    go); False where the runtime is another one (whose threads this leaves alone) or it refused (inside a
    parallel region).
    """
    lib = _gnu_openmp()
    return lib is not None and lib.omp_pause_resource_all(1) == 0  # 1: omp_pause_soft


class RoleMeter:
    """Busy and CPU seconds of one role, and its busy fraction over the last `window_s`."""

    def __init__(self, role: str, num_threads: int, window_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_threads < 1:
            raise ValueError("a role needs at least one thread")
        self.role = role
        self.num_threads = num_threads
        self.window_s = window_s
        self.clock = clock
        self.busy_s = 0.0  # wall time inside the role's work, summed over its threads
        self.cpu_s = 0.0  # CPU time of the role's threads inside that work
        self.num_tasks = 0
        self._recent: deque[tuple[float, float]] = deque()  # (end time, busy seconds), within the window
        self._lock = threading.Lock()

    def record(self, busy_s: float, cpu_s: float = 0.0, end_s: float | None = None) -> None:
        end = self.clock() if end_s is None else end_s
        with self._lock:
            self.busy_s += busy_s
            self.cpu_s += cpu_s
            self.num_tasks += 1
            self._recent.append((end, busy_s))
            self._trim(end)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()

    def busy_fraction(self, now: float | None = None) -> float:
        """Share of the role's thread time spent working over the last `window_s` (0..1)."""
        now = self.clock() if now is None else now
        with self._lock:
            self._trim(now)
            busy = sum(min(b, self.window_s) for _, b in self._recent)
        return min(1.0, busy / (self.window_s * self.num_threads))

    def wrap(self, fn: Callable[..., T]) -> Callable[..., T]:
        """`fn` metered: its wall and thread-CPU time count as this role's work."""
        def metered(*args: Any, **kwargs: Any) -> T:
            t0, c0 = self.clock(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                end = self.clock()
                self.record(end - t0, time.thread_time() - c0, end)

        return metered


class RolePool(ThreadPoolExecutor):
    """A thread pool for one role: `num_threads` threads, pinned to `cpus` if given, every task metered."""

    def __init__(self, role: str, num_threads: int, cpus: frozenset[int] | None = None,
                 window_s: float = 10.0) -> None:
        self.meter = RoleMeter(role, num_threads, window_s)
        self.cpus = cpus
        self.pinned = False
        super().__init__(num_threads, thread_name_prefix=role, initializer=self._init_thread)

    @property
    def role(self) -> str:
        return self.meter.role

    def _init_thread(self) -> None:
        self.pinned = pin_current_thread(self.cpus) or self.pinned

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return super().submit(self.meter.wrap(fn), *args, **kwargs)

    def submit_unmetered(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Run `fn` on the pool without counting it as the role's work (e.g. warming the threads)."""
        return super().submit(fn, *args, **kwargs)


class CpuRoles:
    """The roles of one process, by name: what /metrics reports."""

    def __init__(self) -> None:
        self.meters: dict[str, RoleMeter] = {}

    def add(self, meter: RoleMeter) -> RoleMeter:
        self.meters[meter.role] = meter
        return meter

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {role: {"threads": m.num_threads, "busy_s": m.busy_s, "cpu_s": m.cpu_s, "tasks": m.num_tasks,
                       "busy_fraction": m.busy_fraction()} for role, m in self.meters.items()}
