"""`sessionserve serve` starts on the embedded default model with no model argument, states its KV tiers, and stops
cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx

from tests.server.conftest import free_port, wait_healthy


def test_serve_starts_on_the_default_model_and_drains_on_sigterm() -> None:
    port = free_port()
    # A host tier on a CPU is the same RAM as the device KV: its bytes join the device KV, and the banner says so.
    proc = subprocess.Popen([sys.executable, "-m", "sessionserve.cli", "serve", "--port", str(port),
                             "--kv-cache-bytes", str(96 << 20), "--host-kv-bytes", str(32 << 20)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, lambda: proc.poll() is None)
        except RuntimeError:
            raise AssertionError(proc.stdout.read() if proc.poll() is not None else "no /health") from None
        models = httpx.get(url + "/v1/models").json()["data"]
        assert models[0]["id"] == "llama-small"
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"model": "llama-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    # uvicorn re-raises the signal once shutdown is complete, so -SIGTERM is a clean exit too.
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "Application shutdown complete" in out
    assert "KV cache: device 128 MiB" in out and "host tier off" in out, out
    assert "added to the device KV" in out, out
