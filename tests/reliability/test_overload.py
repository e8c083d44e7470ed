"""A burst bigger than the KV pool and the queue: requests queue or get a 429, running sessions finish.

The pool holds ~4 requests; the server takes at most 8 in flight. A burst of
40 arrives while two sessions stream long turns. Every answer is a 200 with
all its tokens or a 429 with OpenAI error JSON and Retry-After; never a 5xx.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from pathlib import Path

import httpx

from tests.reliability.conftest import ALICE, assert_all_free, close_all_sessions, live_server, wait_idle

NUM_BURST = 40
MAX_TOKENS = 100


def _post(url: str, i: int) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"burst request {i} " + "pad " * 40}],
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=ALICE, timeout=120)


def _session_turn(url: str, sid: str, started: threading.Event) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"long task for {sid}"}], "max_tokens": 200,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    last: dict = {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120,
                      headers={**ALICE, "X-Session-ID": sid}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                last = json.loads(line[len("data: "):])
                started.set()
    return last


def test_burst_over_kv_pool_and_queue_limit(tiny_llama: Path, tmp_path: Path) -> None:
    with live_server(tiny_llama, tmp_path / "spool", num_blocks=40, max_num_seqs=4, host_kv_bytes=0,
                     disk_kv_bytes=0, app_options={"max_queued_requests": 8}) as server, \
            concurrent.futures.ThreadPoolExecutor(NUM_BURST + 3) as pool:
        started = [threading.Event(), threading.Event()]
        sessions = [pool.submit(_session_turn, server.url, f"agent-{k}", started[k]) for k in range(2)]
        for ev in started:
            assert ev.wait(60)
        # Hold the engine thread for a moment so the burst piles up as it would on a busy server (on an
        # idle machine a tiny model answers faster than one test process can send).
        gate = threading.Event()
        hold = pool.submit(server.call, lambda e: gate.wait(30))
        futures = [pool.submit(_post, server.url, i) for i in range(NUM_BURST)]
        threading.Timer(1.0, gate.set).start()
        burst = [f.result() for f in futures]
        hold.result()
        finals = [f.result() for f in sessions]

        statuses = [r.status_code for r in burst]
        assert set(statuses) <= {200, 429}, statuses
        assert statuses.count(429) >= 1 and statuses.count(200) >= 4, statuses
        for r in burst:
            if r.status_code == 429:
                err = r.json()["error"]
                assert err["type"] == "rate_limit_error" and err["message"], err
                assert r.headers["retry-after"] == "1"
            else:
                assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
        for last in finals:  # the sessions' turns ran to their end through the burst
            assert last["usage"]["completion_tokens"] == 200, last
        errors = httpx.get(server.url + "/metrics").text
        assert not [ln for ln in errors.splitlines() if ln.startswith('sessionserve_request_errors_total{status="5')]

        wait_idle(server)
        assert close_all_sessions(server) >= 2
        assert_all_free(server)
