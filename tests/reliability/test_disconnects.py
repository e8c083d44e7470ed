"""Clients that hang up: hundreds of disconnects mid-prefill and mid-stream leave nothing behind.

Each hang-up must abort its request: afterwards no request is running, no
stream is registered, no tenant has a request in flight, every session can
take its next turn, and once the sessions close every KV block is free.
"""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import httpx
import pytest

from tests.reliability.conftest import ALICE, assert_all_free, chat, close_all_sessions, live_server, wait_idle
from tests.server.conftest import LiveServer

NUM_WORKERS = 6
NUM_PER_WORKER = 45  # 270 hang-ups in all
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 60  # ~600 tokens: a prefill of tens of ms


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    spool = tmp_path_factory.mktemp("spool")
    with live_server(tiny_llama, spool, num_blocks=256, host_kv_bytes=8 << 20, disk_kv_bytes=0,
                     residency_policy="predictive") as s:
        yield s


def _hang_up(server: LiveServer, worker: int, i: int) -> str:
    """One request that the client abandons; which way depends on `i`. Returns the way."""
    kind = ("prefill", "stream", "blocking")[i % 3]
    headers = dict(ALICE)
    if i % 2 == 0:  # half of them are turns of the worker's session, half plain requests
        headers["X-Session-ID"] = f"hangup-{worker}"
    # A session's turns resend its conversation (one long prompt); plain requests each start a new one.
    if "X-Session-ID" in headers:
        content = f"worker {worker}: {LONG_PROMPT}"
    else:
        content = LONG_PROMPT if kind == "prefill" else f"worker {worker} request {i}"
    # 2000 tokens: a request the server failed to abort would still be running long after the test's wait.
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2000,
            "ignore_eos": True, "temperature": 0, "stream": kind != "blocking"}
    url = server.url + "/v1/chat/completions"
    if kind == "blocking":
        try:  # the client gives up while the server is still generating
            r = httpx.post(url, json=body, headers=headers, timeout=0.05 + 0.01 * (i % 7))
        except httpx.TimeoutException:
            return kind
        assert r.status_code == 409, (r.status_code, r.text)  # the session's previous turn is being aborted
        return "busy"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        if r.status_code != 200:  # the session's previous turn is still being aborted
            assert r.status_code == 409, (r.status_code, r.read())
            return "busy"
        # The role chunk goes out before the prompt is prefilled; later chunks carry tokens.
        num_lines = 1 if kind == "prefill" else 2 + 2 * (i % 5)
        for n, _ in enumerate(r.iter_lines()):
            if n + 1 >= num_lines:
                break
    return kind


def test_hundreds_of_hang_ups_leak_no_request_and_no_block(server: LiveServer) -> None:
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(NUM_WORKERS) as pool:
        futures = [pool.submit(lambda w=w: [_hang_up(server, w, i) for i in range(NUM_PER_WORKER)])
                   for w in range(NUM_WORKERS)]
        kinds = [k for f in futures for k in f.result()]
    elapsed_s = time.monotonic() - t0
    assert len(kinds) == NUM_WORKERS * NUM_PER_WORKER
    assert sum(k in ("prefill", "stream", "blocking") for k in kinds) >= 200, kinds
    assert elapsed_s < 120, elapsed_s

    # Every request was aborted (400 tokens each would keep the engine busy for many seconds).
    wait_idle(server, timeout_s=5)
    assert server.call(lambda e: (e.kv.check_integrity(), len(e.core.requests))) == (None, 0)

    # Each session took aborted turns; it is parked and takes its next turn.
    for w in range(NUM_WORKERS):
        r = chat(server, [{"role": "user", "content": "and now finish"}], session_id=f"hangup-{w}", max_tokens=4)
        assert r.status_code == 200, r.text
        info = httpx.get(f"{server.url}/v1/sessions/hangup-{w}", headers=ALICE).json()
        assert info["state"] == "parked", info

    text = httpx.get(server.url + "/metrics").text
    running = [ln for ln in text.splitlines() if ln.startswith("sessionserve_num_requests_running{")]
    assert len(running) == 1 and running[0].endswith("} 0.0"), running

    wait_idle(server)
    assert close_all_sessions(server) >= NUM_WORKERS
    assert_all_free(server)
