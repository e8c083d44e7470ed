"""A server in its own process for a benchmark: start it, wait until /health answers, stop it."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def server_process(cmd: list[str], port: int, log_path: Path, *, env: dict[str, str] | None = None,
                   start_timeout_s: float = 600.0, name: str = "server") -> Iterator[float]:
    """Run `cmd` (output to `log_path`) until the block ends; yields the seconds it took to become healthy.

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
            yield startup_s
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
