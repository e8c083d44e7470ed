"""Limits hold and answer with OpenAI's error JSON: request size (declared or streamed), context length,
sessions per tenant; and the prefix cache gives no tenant a timing signal about another's prompts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.reliability.conftest import ALICE, BOB, assert_all_free, chat, close_all_sessions, live_server, wait_idle
from tests.server.conftest import LiveServer

MAX_BYTES = 64 << 10
MAX_SESSIONS = 3


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    spool = tmp_path_factory.mktemp("limits") / "spool"
    with live_server(tiny_llama, spool, {"max_request_bytes": MAX_BYTES, "max_sessions_per_tenant": MAX_SESSIONS},
                     num_blocks=2048, max_num_batched_tokens=2048) as s:
        yield s


def _error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["type"]
    if code is not None:
        assert err["code"] == code, err
    return err


def _healthy(server: LiveServer) -> None:
    r = chat(server, [{"role": "user", "content": "still there?"}], max_tokens=2)
    assert r.status_code == 200, r.text


def test_oversized_bodies_are_refused_declared_or_streamed(server: LiveServer) -> None:
    big = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * MAX_BYTES + b'"}]}'
    url = server.url + "/v1/chat/completions"
    _error(httpx.post(url, content=big, headers={**ALICE, "content-type": "application/json"}, timeout=60),
           413, "request_too_large")

    def chunked() -> Iterator[bytes]:  # no content-length: the server finds out while reading
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]

    _error(httpx.post(url, content=chunked(), headers={**ALICE, "content-type": "application/json"}, timeout=60),
           413, "request_too_large")
    _error(httpx.post(server.url + "/v1/sessions", content=chunked(), headers=ALICE, timeout=60),
           413, "request_too_large")
    # Just under the limit is an ordinary request.
    ok = b'{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "' + b"y" * 2000 + b'"}]}'
    assert httpx.post(url, content=iter([ok]), headers=ALICE, timeout=60).status_code == 200
    _healthy(server)


def test_context_length_is_enforced(server: LiveServer) -> None:
    limit = server.engine.max_model_len
    long_prompt = " ".join(f"w{i}" for i in range(limit))  # well over `limit` tokens, under the byte limit
    _error(chat(server, [{"role": "user", "content": long_prompt}], max_tokens=1), 400, "context_length_exceeded")
    err = _error(chat(server, [{"role": "user", "content": "hi"}], max_tokens=limit + 1), 400,
                 "context_length_exceeded")
    assert err["param"] == "max_tokens"
    r = httpx.post(server.url + "/v1/completions", headers=ALICE, timeout=60,
                   json={"model": "tiny", "prompt": [1] * (limit + 5), "max_tokens": 1})
    _error(r, 400, "context_length_exceeded")
    _healthy(server)


def test_sessions_per_tenant_are_limited(server: LiveServer) -> None:
    close_all_sessions(server)
    for i in range(MAX_SESSIONS):
        assert httpx.post(server.url + "/v1/sessions", headers=ALICE, json={"session_id": f"s{i}"}).status_code == 200
    _error(httpx.post(server.url + "/v1/sessions", headers=ALICE, json={"session_id": "one-too-many"}), 429,
           "too_many_sessions")
    # A turn naming a new session id would open one: refused the same way.
    _error(chat(server, [{"role": "user", "content": "hi"}], session_id="another", max_tokens=1), 429,
           "too_many_sessions")
    # Existing sessions still take turns; another tenant is not affected.
    assert chat(server, [{"role": "user", "content": "hi"}], session_id="s0", max_tokens=1).status_code == 200
    assert httpx.post(server.url + "/v1/sessions", headers=BOB, json={"session_id": "s0"}).status_code == 200
    # Closing one makes room again.
    assert httpx.delete(server.url + "/v1/sessions/s1", headers=ALICE).status_code == 200
    assert httpx.post(server.url + "/v1/sessions", headers=ALICE, json={"session_id": "s9"}).status_code == 200
    wait_idle(server)
    close_all_sessions(server)


def test_no_cross_tenant_prefix_hit_by_timing(server: LiveServer) -> None:
    """What an attacker can measure: bob's first request with alice's prompt costs what a miss costs, not
    what a hit costs. The gap between hit and miss is real here (long prompts on a small model), so a
    shared cache would show."""
    def timed(headers: dict[str, str], content: str) -> float:
        t0 = time.perf_counter()
        r = chat(server, [{"role": "user", "content": content}], headers=headers, max_tokens=1)
        assert r.status_code == 200, r.text
        return time.perf_counter() - t0

    def prompt(tag: str) -> str:
        return " ".join(f"{tag}{i}" for i in range(440))  # ~3,400 tokens, under the tiny model's 4,096

    chat(server, [{"role": "user", "content": "warm up"}], max_tokens=1)
    hits, cross, misses = [], [], []
    for i in range(5):
        secret = prompt(f"secret{i}x")
        timed(ALICE, secret)                          # alice's prompt is now in her cache
        hits.append(timed(ALICE, secret))             # alice again: a hit
        cross.append(timed(BOB, secret))              # bob, same prompt
        misses.append(timed(BOB, prompt(f"fresh{i}y")))  # bob, a prompt nobody sent
    hit, cross_t, miss = (statistics.median(x) for x in (hits, cross, misses))
    assert miss > 2 * hit, (hits, misses)  # the signal exists
    assert cross_t > 0.6 * miss and cross_t > 1.5 * hit, (hits, cross, misses)
    wait_idle(server)
    close_all_sessions(server)
    assert_all_free(server)
