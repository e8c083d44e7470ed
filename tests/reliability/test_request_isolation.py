"""A request's own bad input stays its own: validated at the door, bounded off the shared threads.

Each case once stalled or failed other tenants' requests: sampling values the
engine could not take (a seed past int64, a logit_bias token past the
vocabulary), a multi-megabyte prompt tokenized before its length was checked,
a grammar that takes minutes to compile, streaming requests over the queue
limit answered 200, and requests that kept their place in the queue after the
client had gone.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from sessionserve.server.turn import generate
from tests.reliability.conftest import ALICE, BOB, chat, live_server, wait_idle, wait_until
from tests.server.conftest import LiveServer


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    with live_server(tiny_llama, tmp_path_factory.mktemp("spool")) as s:
        yield s


def _metric(server: LiveServer, name: str, **labels: str) -> float:
    """A gauge's value (the engine samples them after steps and every second while idle)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for line in httpx.get(server.url + "/metrics").text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        time.sleep(0.2)
    raise AssertionError(f"no {name}{{{want}}} in /metrics")


@pytest.mark.parametrize("field", [{"seed": 2**63}, {"seed": -(2**63) - 1}, {"seed": 2**70},
                                   {"logit_bias": {"999999999": 5}}, {"logit_bias": {"16384": -100}},
                                   {"stop_token_ids": [1 << 40]}])
def test_sampling_values_the_model_cannot_take_are_a_400(server: LiveServer, field: dict) -> None:
    r = chat(server, [{"role": "user", "content": "hi"}], max_tokens=4, temperature=1.0, **field)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    comp = httpx.post(server.url + "/v1/completions", headers=ALICE, timeout=60,
                      json={"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 1.0, **field})
    assert comp.status_code == 400, comp.text


def test_seeds_across_the_int64_range_run(server: LiveServer) -> None:
    for seed in (-(2**63), -1, 2**63 - 1):
        r = chat(server, [{"role": "user", "content": "hi"}], max_tokens=4, temperature=1.0, seed=seed)
        assert r.status_code == 200, r.text


def test_a_huge_prompt_is_refused_before_it_is_tokenized(server: LiveServer) -> None:
    text = "lorem ipsum dolor sit amet " * 150_000  # 4.05 MB: just under the body limit
    health: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            httpx.get(server.url + "/health", timeout=30)
            health.append(time.perf_counter() - t0)
            time.sleep(0.05)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        prober = pool.submit(probe)
        t0 = time.perf_counter()
        r = chat(server, [{"role": "user", "content": text}], max_tokens=4,
                 headers={**BOB}, timeout_s=60)
        elapsed = time.perf_counter() - t0
        done.set()
        prober.result()
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert elapsed < 5, elapsed  # parsing 4 MB of JSON, not tokenizing it (8 MB took ~20 s)
    assert max(health) < 2, health


def test_a_grammar_too_slow_to_compile_is_a_400_and_others_compile(server: LiveServer,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generate, "GRAMMAR_TIMEOUT_S", 1.0)
    slow = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(3000)}}  # minutes
    t0 = time.perf_counter()
    r = chat(server, [{"role": "user", "content": "hi"}], max_tokens=4, headers=BOB,
             response_format={"type": "json_schema", "json_schema": {"name": "slow", "schema": slow}})
    assert r.status_code == 400 and "took longer than 1 s to compile" in r.json()["error"]["message"], r.text
    assert time.perf_counter() - t0 < 60  # the child process starts, then 1 s
    ok = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    r = chat(server, [{"role": "user", "content": "hi"}], max_tokens=20,
             response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": ok}})
    assert r.status_code == 200, r.text
    deep: dict = {"type": "string"}
    for _ in range(300):
        deep = {"type": "array", "items": deep}
    r = chat(server, [{"role": "user", "content": "hi"}], max_tokens=4, headers=BOB,
             response_format={"type": "json_schema", "json_schema": {"name": "deep", "schema": deep}})
    assert r.status_code == 400, r.text
    wait_idle(server)


def test_streaming_requests_over_the_queue_limit_get_429_before_the_stream(tiny_llama: Path,
                                                                           tmp_path: Path) -> None:
    with live_server(tiny_llama, tmp_path / "spool", app_options={"max_queued_requests": 4}) as server, \
            concurrent.futures.ThreadPoolExecutor(24) as pool:
        gate = threading.Event()
        hold = pool.submit(server.call, lambda e: gate.wait(30))  # a busy engine: the burst piles up

        def stream(i: int) -> tuple[int, str | None, str]:
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"burst {i}"}], "max_tokens": 8,
                    "stream": True}
            with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=ALICE,
                              timeout=60) as r:
                return r.status_code, r.headers.get("retry-after"), r.read().decode()

        futures = [pool.submit(stream, i) for i in range(20)]
        time.sleep(1.0)
        gate.set()
        hold.result()
        results = [f.result() for f in futures]
    refused = [r for r in results if r[0] == 429]
    assert refused, "no request was over the limit"
    assert all(status in (200, 429) for status, _, _ in results)
    for _, retry_after, body in refused:
        assert retry_after is not None and int(retry_after) >= 1
        assert '"rate_limit_error"' in body and not body.startswith("data:")
    for status, _, body in results:
        if status == 200:
            assert '"error"' not in body and body.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_client_left_while_queued_computes_nothing(server: LiveServer, stream: bool) -> None:
    wait_idle(server)
    before = {k: _metric(server, "sessionserve_aborted_requests", stage=k) for k in ("before_start", "running")}
    prefill_before = _metric(server, "sessionserve_aborted_prefill_tokens")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "queued " + "x " * 200}], "max_tokens": 8,
            "stream": stream}

    def send() -> None:
        with contextlib.suppress(httpx.TimeoutException):  # the client gives up: it hangs up
            httpx.post(server.url + "/v1/chat/completions", json=body, headers=ALICE, timeout=3.0)

    bridge = server.app.state.ss.bridge
    first, second = threading.Event(), threading.Event()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # The engine thread is busy (held) while the requests arrive; their adds queue behind it, and a
        # second hold behind them: once added they wait in the engine's queue, unscheduled, until after
        # their clients have gone.
        holds = [pool.submit(server.call, lambda e: first.wait(30))]
        senders = [threading.Thread(target=send) for _ in range(3)]
        for t in senders:
            t.start()
        wait_until(lambda: bridge._num_adding >= 3, 20, "the requests reach the engine's queue")
        holds.append(pool.submit(server.call, lambda e: second.wait(30)))
        wait_until(lambda: bridge._commands.qsize() >= 4, 20, "the second hold queued behind them")
        first.set()
        for t in senders:
            t.join()
        wait_until(lambda: bridge._commands.qsize() >= 3, 20, "the aborts queued")
        second.set()
        for h in holds:
            h.result()
    wait_idle(server)
    wait_until(lambda: _metric(server, "sessionserve_aborted_requests", stage="before_start")
               == before["before_start"] + 3, 10, "three requests aborted before they started")
    assert _metric(server, "sessionserve_aborted_requests", stage="running") == before["running"]
    assert _metric(server, "sessionserve_aborted_prefill_tokens") == prefill_before
    assert server.call(lambda e: (e.kv.check_integrity(), not e.has_unfinished())[1])


def test_gauges_follow_expiry_without_traffic(tiny_llama: Path, tmp_path: Path) -> None:
    with live_server(tiny_llama, tmp_path / "spool", session_idle_ttl_s=1.0) as server:
        for i in range(3):
            assert chat(server, [{"role": "user", "content": f"agent {i}"}], session_id=f"exp-{i}",
                        max_tokens=4).status_code == 200

        def open_sessions() -> float:
            text = httpx.get(server.url + "/metrics").text
            return sum(float(m.group(1)) for m in re.finditer(r'^sessionserve_sessions\{[^}]*\} (\S+)$', text, re.M))

        assert open_sessions() >= 3
        wait_until(lambda: open_sessions() == 0, 30, "session gauges at 0 after the sessions expired")
        assert _metric(server, "sessionserve_kv_blocks", tier="device") == 0
        assert _metric(server, "sessionserve_kv_blocks", tier="disk") == 0
