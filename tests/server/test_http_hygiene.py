"""HTTP hygiene against a live server: session ids the server cannot use as sent, request ids per tenant,
deeply nested JSON, keys for /metrics and the API description, and an OpenAPI document that says what
each route takes and how it fails."""

from __future__ import annotations

import inspect
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessionserve.server import protocol as P
from sessionserve.server.protocol_common import client_session_id
from sessionserve.server.turn import generate
from tests.reliability.conftest import ALICE, BOB, chat, live_server
from tests.server.conftest import LiveServer

ANTHROPIC = {"x-api-key": "key-alice", "anthropic-version": "2023-06-01"}
WARNING = "x-sessionserve-warning"


def _turns(server: LiveServer, headers: dict[str, str]) -> tuple[httpx.Response, httpx.Response]:
    """Two turns of one conversation (the second extends the first's reply)."""
    msgs = [{"role": "user", "content": "Tell me about the replay trace " * 4}]
    first = chat(server, msgs, headers=headers, max_tokens=4)
    assert first.status_code == 200, first.text
    msgs += [first.json()["choices"][0]["message"], {"role": "user", "content": "and then?"}]
    second = chat(server, msgs, headers=headers, max_tokens=4)
    assert second.status_code == 200, second.text
    return first, second


def _chat_body_sid(server: LiveServer, session_id: str) -> httpx.Response:
    """A one-token chat turn naming its session in the body's `session_id`."""
    return httpx.post(server.url + "/v1/chat/completions", headers=ALICE, timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "session_id": session_id})


# -- 1. session ids --------------------------------------------------------------------------------------


def test_session_id_mapping_is_deterministic_and_valid() -> None:
    mapped = client_session_id("trace_0100#0").session_id
    assert mapped is not None and mapped.startswith("trace_0100_0-") and P.valid_session_id(mapped)
    assert client_session_id("trace_0100#0").session_id == mapped  # the same client id, the same session
    assert client_session_id("trace_0100_0").session_id == "trace_0100_0"  # valid ids are never mapped
    assert client_session_id("trace_0100_0").session_id != mapped
    for dots in (".", ".."):
        sid = client_session_id(dots).session_id
        assert sid is not None and sid not in (".", "..") and P.valid_session_id(sid)
    for unusable in ("", "  ", "x\x00y", "tab\there", "\ud800", "a" * 513):
        sid, problem = client_session_id(unusable)
        assert sid is None and problem


def test_a_mapped_session_id_continues_its_session(server: LiveServer) -> None:
    first, second = _turns(server, {"X-Session-ID": "trace_0100#0"})
    sid = first.headers["x-session-id"]
    assert sid == second.headers["x-session-id"] and sid.startswith("trace_0100_0-") and WARNING not in first.headers
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    info = httpx.get(f"{server.url}/v1/sessions/{sid}", headers=ALICE)
    assert info.status_code == 200 and info.json()["steps"] == 2, info.text
    # The body's session_id maps the same way; a valid id is used as sent.
    msgs = [{"role": "user", "content": "hi"}]
    assert _chat_body_sid(server, "trace_0100#0").headers["x-session-id"] == sid
    assert chat(server, msgs, max_tokens=1, session_id="trace_0100_0").headers["x-session-id"] == "trace_0100_0"
    for s in (sid, "trace_0100_0"):
        assert httpx.delete(f"{server.url}/v1/sessions/{s}", headers=ALICE).status_code == 200


@pytest.mark.parametrize("where,raw", [("body", ""), ("body", "x\x00y"), ("body", "a" * 600),
                                       ("header", "a" * 600)])
def test_ids_that_cannot_name_a_session_are_ignored_with_a_warning(server: LiveServer, where: str,
                                                                   raw: str) -> None:
    if where == "header":
        r = chat(server, [{"role": "user", "content": "hi"}], max_tokens=1, session_id=raw)
    else:
        r = _chat_body_sid(server, raw)
    assert r.status_code == 200, r.text
    assert r.headers[WARNING].startswith("session id ignored") and "x-session-id" not in r.headers


def test_an_ignored_header_id_leaves_the_body_id(server: LiveServer) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", headers={**ALICE, "X-Session-ID": "a" * 600}, timeout=60,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                         "stream": True, "session_id": "body#1"})
    assert r.status_code == 200 and r.headers["x-session-id"] == client_session_id("body#1").session_id
    assert r.headers[WARNING] == "session id ignored (X-Session-ID): it is over 512 characters"
    assert httpx.delete(f"{server.url}/v1/sessions/{r.headers['x-session-id']}", headers=ALICE).status_code == 200


def test_dot_ids_are_never_session_ids(server: LiveServer) -> None:
    msgs = [{"role": "user", "content": "dots"}]
    for dots in (".", ".."):
        r = chat(server, msgs, max_tokens=1, session_id=dots)
        assert r.status_code == 200 and r.headers["x-session-id"] not in (".", ".."), r.headers
        r = httpx.post(server.url + "/v1/sessions", headers=ALICE, json={"session_id": dots})
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_id"
    assert chat(server, msgs, max_tokens=1, session_id="dot-parent").status_code == 200
    for encoded in ("%2e", "%2e%2e", "%2E%2E"):
        for method, tail in (("GET", ""), ("DELETE", ""), ("POST", "/fork")):
            r = httpx.request(method, f"{server.url}/v1/sessions/{encoded}{tail}", headers=ALICE)
            assert r.status_code == 400, (method, encoded, r.text)
    assert httpx.post(f"{server.url}/v1/sessions/dot-parent/fork", headers=ALICE,
                      json={"session_id": ".."}).status_code == 400
    assert httpx.delete(f"{server.url}/v1/sessions/dot-parent", headers=ALICE).status_code == 200


# -- 2. request ids per tenant ---------------------------------------------------------------------------


@pytest.fixture
def running_job(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Alice's streamed request `job-42`, in the engine until the test ends (then aborted)."""
    executor = server.engine.core.executor
    real = executor.execute

    def slow(plan: Any) -> Any:  # ~10 ms a step: the job cannot finish its tokens before the checks
        time.sleep(0.01)
        return real(plan)

    monkeypatch.setattr(executor, "execute", slow)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 1000,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={**ALICE, "X-Request-ID": "job-42"}) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "job-42"
        lines = r.iter_lines()  # NOTE: kept until the end: a dropped iterator closes the stream (an abort)
        next(lines)  # the engine has taken it
        yield
        assert server.call(lambda e: e.has_unfinished()), "job-42 ended before the checks were done"


def test_a_request_id_in_use_by_the_same_tenant_is_a_clear_client_error(server: LiveServer,
                                                                        running_job: None) -> None:
    r = chat(server, [{"role": "user", "content": "again"}], headers={"X-Request-ID": "job-42"}, max_tokens=1)
    assert r.status_code in (400, 409) and "job-42" in r.json()["error"]["message"], r.text


@pytest.mark.xfail("engine_request_id" not in inspect.getsource(generate), strict=True,
                   reason="turn/generate.py still submits request.state.request_id to the engine")
def test_tenants_share_no_request_id_namespace(server: LiveServer, running_job: None) -> None:
    r = chat(server, [{"role": "user", "content": "bob's job"}], headers={**BOB, "X-Request-ID": "job-42"},
             max_tokens=1)
    assert r.status_code == 200 and r.headers["x-request-id"] == "job-42", r.text


# -- 3. deeply nested JSON -------------------------------------------------------------------------------


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(("text", "nests_past"), [
    ('{"a": "' + "[" * 200 + '"}', False),  # brackets only inside a string
    ('{"a": ' + "[" * 100 + "1" + "]" * 100 + "}", False),  # 101 levels
    ('{"a": ' + "[" * 128 + "1" + "]" * 128 + "}", True),  # 129
    ('{"prompt": ' + json.dumps(list(range(5000))) + "}", False),  # few brackets: no scan needed
])
def test_nesting_is_judged_on_the_text(text: str, nests_past: bool) -> None:
    from sessionserve.server.app import _decode_json, json_text_depth

    body, depth = _decode_json(text.encode(), 128)
    assert body == json.loads(text)
    assert (depth > 128) is nests_past and (json_text_depth(text.encode()) > 128) is nests_past


@pytest.mark.parametrize("depth", [128, 900, 5_000, 200_000])  # plus the body object: 129 levels and up
def test_deeply_nested_bodies_are_400_and_the_connection_lives_on(server: LiveServer, depth: int) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        ok = c.post("/v1/chat/completions", headers=ALICE,
                    json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        port = ok.extensions["network_stream"].get_extra_info("client_addr")[1]
        cases = [("/v1/chat/completions", ALICE, f'{{"model": "tiny", "messages": {_nested(depth)}}}'),
                 ("/v1/messages", ANTHROPIC, f'{{"model": "tiny", "max_tokens": 1, "metadata": {_nested(depth)}}}'),
                 ("/v1/sessions", ALICE, f'{{"session_id": {_nested(depth)}}}')]
        for path, headers, body in cases:
            r = c.post(path, headers={**headers, "content-type": "application/json"}, content=body)
            assert r.status_code == 400, (path, r.status_code, r.text[:200])
            if path == "/v1/messages":
                assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
            else:
                assert r.json()["error"]["type"] == "invalid_request_error"
            assert "nested deeper than 128" in r.text
        again = c.post("/v1/chat/completions", headers=ALICE,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert again.status_code == 200
        assert again.extensions["network_stream"].get_extra_info("client_addr")[1] == port  # kept alive


def test_nesting_up_to_the_limit_is_accepted(server: LiveServer) -> None:
    # 128 levels: the body object and 127 lists.
    body = f'{{"model": "tiny", "max_tokens": 1, "messages": [{{"role": "user", "content": "hi"}}], ' \
           f'"extra": {_nested(127)}}}'
    assert json.loads(body)  # sanity: valid JSON
    r = httpx.post(server.url + "/v1/chat/completions", headers={**ALICE, "content-type": "application/json"},
                   content=body, timeout=60)
    assert r.status_code == 200, r.text


# -- 4. keys for /metrics and the API description --------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tiny_llama, tmp_path_factory.mktemp("keyed") / "spool", {"metrics_auth": "key"},
                     num_blocks=16) as s:
        yield s


@pytest.mark.parametrize("path", ["/metrics", "/openapi.json", "/docs"])
def test_metrics_and_api_description_need_a_key_when_configured(server: LiveServer, keyed_server: LiveServer,
                                                                path: str) -> None:
    assert httpx.get(server.url + path).status_code == 200  # default: open, as Prometheus scrapers expect
    r = httpx.get(keyed_server.url + path)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(keyed_server.url + path, headers={"Authorization": "Bearer key-wrong"}).status_code == 401
    assert httpx.get(keyed_server.url + path, headers=BOB).status_code == 200
    assert httpx.get(keyed_server.url + "/health").status_code == 200  # load balancers' checks stay open


# -- 5. the OpenAPI document -----------------------------------------------------------------------------


def test_openapi_declares_request_bodies_and_errors(server: LiveServer) -> None:
    doc = httpx.get(server.url + "/openapi.json").json()
    chat_op = doc["paths"]["/v1/chat/completions"]["post"]
    schema = chat_op["requestBody"]["content"]["application/json"]["schema"]
    assert chat_op["requestBody"]["required"] is True
    assert {"model", "messages"} <= set(schema["required"]) and "messages" in schema["properties"]
    assert {"400", "401", "404", "409", "413", "429", "500"} <= set(chat_op["responses"])
    error = chat_op["responses"]["429"]["content"]["application/json"]["schema"]
    assert error["properties"]["error"]["required"] == ["message", "type"]
    posts = {path: ops["post"] for path, ops in doc["paths"].items() if "post" in ops}
    assert {"/v1/completions", "/v1/responses", "/v1/messages", "/v1/sessions"} <= set(posts)
    for path, op in posts.items():
        assert "application/json" in op["requestBody"]["content"] and "400" in op["responses"], path
    anthropic = posts["/v1/messages"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert anthropic["properties"]["type"] == {"const": "error"}
    assert "#/$defs/" not in json.dumps(doc)  # every reference resolves from the document's root


def test_answers_refused_at_the_door_carry_the_request_id(server: LiveServer) -> None:
    """A missing key (401) and a declared body over the limit (413) are answered before any route runs, in
    the path's protocol, with the client's X-Request-ID like every other answer."""
    r = httpx.post(server.url + "/v1/chat/completions", json={}, headers={"X-Request-ID": "door-1"}, timeout=30)
    assert r.status_code == 401 and r.headers["x-request-id"] == "door-1"
    assert r.json()["error"]["code"] == "invalid_api_key"
    url = httpx.URL(server.url)
    with socket.create_connection((url.host, url.port), timeout=30) as s:  # the body never comes
        s.sendall(f"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: key-alice\r\nX-Request-ID: door-2\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {1 << 40}\r\n\r\n{{".encode())
        answer = b""
        while b"}" not in answer.partition(b"\r\n\r\n")[2]:  # the head, then the JSON body
            chunk = s.recv(65536)
            assert chunk, answer
            answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"x-request-id: door-2" in head.lower(), head
    assert json.loads(body)["type"] == "error", body
