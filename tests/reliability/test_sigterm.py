"""SIGTERM with streams in flight: `sessionserve serve` drains them, then exits cleanly and soon.

Also checked on the same process's whole log (uvicorn's access log included):
neither a right nor a wrong API key is ever written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.server.conftest import free_port, wait_healthy

KEY = "sk-right-7f3a9c1e5b"
WRONG_KEY = "sk-wrong-2d8e4b6a0c"
NUM_STREAMS = 4
MAX_TOKENS = 250
EXIT_BOUND_S = 30.0


def _stream(url: str, i: int, started: threading.Event, out: dict[int, list[dict]]) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"story {i}"}], "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events: list[dict] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                events.append({"done": True, "at_s": time.monotonic()})
                break
            events.append(json.loads(line[len("data: "):]))
            if len(events) >= 3:
                started.set()
    out[i] = events


def test_sigterm_drains_in_flight_streams_and_exits_cleanly(tiny_llama: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sessionserve.cli", "serve", "--model", str(tiny_llama), "--port", str(port),
         "--served-model-name", "tiny", "--api-key", KEY, "--kv-cache-bytes", str(16 << 20), "--host-kv-bytes", "0",
         "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        try:
            wait_healthy(url, lambda: proc.poll() is None)
        except RuntimeError:
            raise AssertionError(proc.stdout.read() if proc.poll() is not None else "no /health") from None
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {WRONG_KEY}"}).status_code == 401
        results: dict[int, list[dict]] = {}
        started = [threading.Event() for _ in range(NUM_STREAMS)]
        threads = [threading.Thread(target=_stream, args=(url, i, started[i], results)) for i in range(NUM_STREAMS)]
        for t in threads:
            t.start()
        for ev in started:
            assert ev.wait(60), "a stream did not start"
        proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        for t in threads:
            t.join(timeout=EXIT_BOUND_S)
        out, _ = proc.communicate(timeout=EXIT_BOUND_S)
        exit_s = time.monotonic() - t_term
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()

    # Every stream in flight at SIGTERM ran to its end: all its tokens, its finish reason, [DONE].
    assert sorted(results) == list(range(NUM_STREAMS)), out[-3000:]
    for events in results.values():
        assert events[-1]["done"] and events[-1]["at_s"] > t_term, events[-3:]  # in flight at SIGTERM
        finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e.get("choices")]
        assert finish[-1] == "length", events[-4:]
        assert events[-2]["usage"]["completion_tokens"] == MAX_TOKENS, events[-2]
    # uvicorn re-raises the signal once shutdown is complete, so -SIGTERM is a clean exit too.
    assert proc.returncode in (0, -signal.SIGTERM), out[-3000:]
    assert exit_s < EXIT_BOUND_S, exit_s
    assert "Application shutdown complete" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert KEY not in out and WRONG_KEY not in out
