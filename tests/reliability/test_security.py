"""Keys stay out of logs, tenants cannot reach each other's sessions, session ids cannot name paths."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import httpx
import pytest

from sessionserve.core.residency import ActionKind, ResidencyAction
from sessionserve.core.session import Residency
from sessionserve.types.kv_mover import Tier
from sessionserve.server import protocol as P
from tests.reliability.conftest import ALICE, BOB, chat, live_server, wait_until
from tests.server.conftest import KEYS, LiveServer

WRONG_KEY = "key-mallory-0b9e77d1"


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    spool = tmp_path_factory.mktemp("sec") / "spool"
    with live_server(tiny_llama, spool, host_kv_bytes=0) as s:
        s.spool = spool  # type: ignore[attr-defined]
        yield s


def test_api_keys_never_reach_the_logs(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    runner = server.engine.runner
    real = runner._sample_row

    def failing_sampler(seq):
        if seq.request_id.endswith("-logged1"):  # the engine's id: the client's, qualified by its tenant
            raise RuntimeError("injected")
        return real(seq)

    caplog.set_level(logging.DEBUG)
    logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    runner._sample_row = failing_sampler
    try:
        msgs = [{"role": "user", "content": "hi"}]
        for key in (*KEYS, WRONG_KEY):
            for headers in ({"Authorization": f"Bearer {key}"}, {"Authorization": key},
                            {"Authorization": f"bearer {key}"}):
                r = httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=60,
                               json={"model": "tiny", "messages": msgs, "max_tokens": 2})
                assert r.status_code in (200, 401), r.text
                assert key not in r.text
                assert (r.status_code == 200) == (key in KEYS and headers["Authorization"].startswith("Bearer ")), r
        assert chat(server, msgs, headers={"X-Request-ID": "logged1"}, max_tokens=2).status_code == 500
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {WRONG_KEY}"}).status_code == 401
    finally:
        runner._sample_row = real
        logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    # The server's records (this process also holds the test's HTTP client, which logs its own headers).
    server_records = [r for r in caplog.records if not r.name.startswith(("httpx", "httpcore"))]
    text = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in server_records)
    assert "engine step failed" in text  # the capture sees the server's logs
    for key in (*KEYS, WRONG_KEY):
        assert key not in text


def test_another_tenant_cannot_read_resume_fork_or_delete_a_session(server: LiveServer) -> None:
    secret = [{"role": "user", "content": "alice's private plan " * 8}]
    assert chat(server, secret, session_id="private", max_tokens=4).status_code == 200
    url = server.url + "/v1/sessions/private"
    before = httpx.get(url, headers=ALICE).json()

    assert httpx.get(url, headers=BOB).status_code == 404
    assert httpx.post(url + "/fork", headers=BOB, json={"session_id": "stolen"}).status_code == 404
    assert httpx.delete(url, headers=BOB).status_code == 404
    # Bob "resuming" the id gets a session of his own: nothing of alice's is reused.
    r = chat(server, secret, session_id="private", headers=BOB, max_tokens=4)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    after = httpx.get(url, headers=ALICE).json()
    assert (after["num_tokens"], after["steps"]) == (before["num_tokens"], before["steps"])
    assert httpx.get(server.url + "/v1/sessions/stolen", headers=ALICE).status_code == 404
    assert httpx.delete(url, headers=ALICE).json()["deleted"] is True
    assert httpx.delete(url, headers=BOB).json()["deleted"] is True


BAD_IDS = ["../escape", "a/b", "..\\x", "/abs", "a b", "x\x00y", "é", "a" * 129]


def _assert_bad_session_id(r: httpx.Response) -> None:
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", (r.status_code, r.text)


def _assert_safe_session_id(r: httpx.Response, sid: str) -> None:
    """A turn naming `sid` ran, in a session whose id is valid (mapped from `sid`) or in none (ignored)."""
    assert r.status_code == 200, (r.status_code, r.text)
    used = r.headers.get("x-session-id")
    assert (used is not None and used != sid and P.valid_session_id(used)) or \
        (used is None and r.headers["x-sessionserve-warning"].startswith("session id ignored")), r.headers


@pytest.mark.parametrize("sid", BAD_IDS)
def test_session_ids_with_path_characters_never_name_a_path(server: LiveServer, sid: str) -> None:
    # A turn maps the id to a valid one (or ignores it); the session routes refuse it.
    msgs = [{"role": "user", "content": "hi"}]
    _assert_safe_session_id(httpx.post(server.url + "/v1/chat/completions", headers=ALICE, json={
        "model": "tiny", "messages": msgs, "max_tokens": 1, "session_id": sid}), sid)
    _assert_bad_session_id(httpx.post(server.url + "/v1/sessions", headers=ALICE, json={"session_id": sid}))
    assert chat(server, msgs, max_tokens=1, session_id="fork-parent").status_code == 200
    _assert_bad_session_id(httpx.post(server.url + "/v1/sessions/fork-parent/fork", headers=ALICE,
                                      json={"session_id": sid}))
    if sid.isascii() and sid.isprintable():  # what an HTTP header can carry
        _assert_safe_session_id(chat(server, msgs, max_tokens=1, session_id=sid), sid)


def test_path_like_ids_never_reach_the_file_system(server: LiveServer) -> None:
    spool: Path = server.spool  # type: ignore[attr-defined]
    for encoded, status in (("..%2F..%2Fetc%2Fpasswd", 404), ("%2e%2e", 400), ("a%00b", 404)):
        for method in ("GET", "DELETE"):
            r = httpx.request(method, f"{server.url}/v1/sessions/{encoded}", headers=ALICE)
            assert r.status_code == status, (method, encoded, r.text)
    # Ids of allowed characters that look like paths are just names (`..` is mapped to one); spool files
    # are named by the server.
    for sid in ("..", "...", ".:.."):
        r = chat(server, [{"role": "user", "content": f"{sid} " * 20}], session_id=sid, max_tokens=2)
        assert r.status_code == 200 and (r.headers["x-session-id"] == sid) == (sid != ".."), r.headers
        key = f"alice/{r.headers['x-session-id']}"
        server.call(lambda e, k=key: e.sessions.apply(ResidencyAction(ActionKind.OFFLOAD, k, Tier.DISK),
                                                      time.monotonic()))
        wait_until(lambda k=key: server.call(lambda e: e.get_session(k).residency) is Residency.DISK, 10, "on disk")
    names = sorted(p.name for p in spool.iterdir())
    assert len(names) == 3 and all(re.fullmatch(r"[0-9a-f]{32}\.kv", n) for n in names), names
    assert sorted(p.name for p in spool.parent.iterdir()) == ["spool"]
