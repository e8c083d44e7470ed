"""A server in its own process for a benchmark: start it, wait until /health answers, stop it."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_stat(pid: str) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command name (which may hold spaces): fields[0] is field 3 of
    stat(5), the state; fields[2] the process group, fields[11] and [12] user and system ticks. None if
    the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None


def cpu_s(fields: list[bytes]) -> float:
    """User + system CPU seconds from `proc_stat` fields."""
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group `pgid`, from /proc.

    A server and the processes it started (vLLM's engine core) lead one group, so this is the whole server.
    """
    total = 0.0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := proc_stat(entry.name)) is not None and int(fields[2]) == pgid:
            total += cpu_s(fields)
    return total


@dataclass(frozen=True)
class RunningServer:
    startup_s: float
    pid: int  # also its process group

    def cpu_s(self) -> float:
        return group_cpu_s(self.pid)


@contextlib.contextmanager
def sampled(read: Callable[[], float], interval_s: float = 1.0) -> Iterator[list[tuple[float, float]]]:
    """Read a counter (a server's `cpu_s`) every `interval_s` on a thread while the block runs: the list it yields
    fills with (seconds since the block began, value), first and last reads included (`metrics.rate_between`)."""
    samples: list[tuple[float, float]] = []
    t0 = time.monotonic()
    stop = threading.Event()

    def loop() -> None:
        while True:
            samples.append((time.monotonic() - t0, read()))
            if stop.wait(interval_s):
                return

    thread = threading.Thread(target=loop, name="sampler", daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()
        samples.append((time.monotonic() - t0, read()))


@contextlib.contextmanager
def server_process(cmd: list[str], port: int, log_path: Path, *, env: dict[str, str] | None = None,
                   start_timeout_s: float = 600.0, name: str = "server") -> Iterator[RunningServer]:
    """Run `cmd` (output to `log_path`) until the block ends; yields it once healthy (its start-up seconds, pid).

    The process leads its own session, so stopping it (SIGINT, then SIGKILL after 30 s) also stops the
    processes it started (vLLM's engine core). Raises SystemExit if it dies or is not healthy in time.
    """
    import httpx

    print(f"[{name}] {shlex.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}/health"
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"{name} exited with {proc.returncode}; see {log_path}")
                if time.monotonic() - t0 > start_timeout_s:
                    raise SystemExit(f"{name} not healthy after {start_timeout_s:.0f} s; see {log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url, timeout=2).status_code == 200:
                        break
                time.sleep(0.5)
            startup_s = time.monotonic() - t0
            print(f"[{name}] healthy after {startup_s:.0f} s", file=sys.stderr, flush=True)
            yield RunningServer(startup_s, proc.pid)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
