"""The ingress's routing key and the in-process ASGI call a replica makes, without a Ray cluster."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

pytest.importorskip("ray")

from sessionserve.cache.block_hash import extend_block_hashes
from sessionserve.model.tokenizer import Tokenizer
from sessionserve.router.ingress import Ingress
from sessionserve.router.ray_app import ServeOptions
from sessionserve.router.replica import RoutedRequest, asgi_call
from sessionserve.router.store import SessionRecord
from sessionserve.server.auth import tenant_salt
from sessionserve.server.protocol_common import client_session_id
from sessionserve.server.turn.render import render_chat


@pytest.fixture
def ingress(tiny_llama: Path, tmp_path: Path) -> Ingress:
    return Ingress(None, ServeOptions(model=str(tiny_llama), api_keys=(("key-a", "alice"),),
                                      engine_kwargs={"block_size": 16}, store_url=f"sqlite://{tmp_path / 's.db'}"))


def _chat(messages: list[dict], **extra: object) -> bytes:
    return json.dumps({"model": "m", "messages": messages, **extra}).encode()


def test_route_key_of_a_session_turn(ingress: Ingress, tiny_llama: Path) -> None:
    messages = [{"role": "system", "content": "Be brief. " * 30}, {"role": "user", "content": "hi"}]
    headers = {"authorization": "Bearer key-a", "x-session-id": "s1"}
    req = ingress.route_of("POST", "/v1/chat/completions", headers, _chat(messages, stream=True))
    prompt = render_chat(Tokenizer(tiny_llama), messages, None)
    expected = extend_block_hashes([], prompt, 16, salt=tenant_salt("alice"))
    assert len(expected) >= 4 and req.route.block_hashes == tuple(expected)  # what the replica will cache
    assert (req.tenant, req.session_key, req.route.session_key) == ("alice", "alice/s1", "alice/s1")
    assert req.route.owner is None and not req.route.is_released and req.is_stream
    assert req.turn_hash is not None and req.messages == tuple(messages)
    again = ingress.route_of("POST", "/v1/chat/completions", headers, _chat(messages, stream=True))
    assert again.turn_hash == req.turn_hash  # a retry of the same turn has the same fingerprint
    other = ingress.route_of("POST", "/v1/chat/completions", headers, _chat(messages, max_tokens=3))
    assert other.turn_hash != req.turn_hash


def test_route_key_reads_owner_and_release_from_store(ingress: Ingress) -> None:
    headers = {"authorization": "Bearer key-a"}
    rec = ingress.store.put(SessionRecord("alice/s2", "alice", owner="r7"))
    body = _chat([{"role": "user", "content": "x"}], session_id="s2")
    assert ingress.route_of("POST", "/v1/chat/completions", headers, body).route.owner == "r7"
    ingress.store.put(SessionRecord("alice/s2", "alice", version=rec.version, owner=None))
    route = ingress.route_of("POST", "/v1/chat/completions", headers, body).route
    assert route.owner is None and route.is_released
    assert ingress.route_of("GET", "/v1/sessions/s2", headers, b"").session_key == "alice/s2"
    fork = ingress.route_of("POST", "/v1/sessions/s2/fork", headers, b"{}")
    assert fork.session_key == "alice/s2" and fork.route.owner is None and fork.route.is_released


def test_bad_requests_route_anywhere(ingress: Ingress) -> None:
    for body in (b"{not json", b"[1, 2]", _chat("oops")):  # type: ignore[arg-type]
        req = ingress.route_of("POST", "/v1/chat/completions", {}, body)
        assert req.route.block_hashes == () and req.body == body  # the replica answers the 400
    ignored = ingress.route_of("POST", "/v1/chat/completions", {"x-session-id": "a" * 600}, _chat([]))
    assert ignored.session_key is None  # an id the replica ignores names no session
    mapped = ingress.route_of("POST", "/v1/chat/completions", {"x-session-id": "bad id!"}, _chat([]))
    assert mapped.session_key == f"default/{client_session_id('bad id!').session_id}"  # as the replica maps it


def test_asgi_call_streams_an_app_response() -> None:
    app = FastAPI()

    @app.post("/echo")
    async def echo(body: dict) -> StreamingResponse:
        async def chunks():
            for word in body["words"]:
                yield word.encode()
        return StreamingResponse(chunks(), media_type="text/plain", headers={"x-n": str(len(body["words"]))})

    req = RoutedRequest("POST", "/echo", b"", ((b"content-type", b"application/json"),),
                        json.dumps({"words": ["a", "b", "c"]}).encode())

    async def run() -> list[dict]:
        return [m async for m in asgi_call(app, req)]

    msgs = asyncio.run(run())
    assert msgs[0]["type"] == "http.response.start" and msgs[0]["status"] == 200
    assert (b"x-n", b"3") in msgs[0]["headers"]
    assert b"".join(m.get("body", b"") for m in msgs[1:]) == b"abc"


def test_busy_retry_detects_only_a_moving_session_before_output() -> None:
    from sessionserve.router.replica import _has_output, _is_moving_busy

    role = b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'
    token = b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n'
    busy = (b'data: {"error": {"message": "session \'t/s\' is being moved; retry", "code": "session_busy"}}\n\n'
            b"data: [DONE]\n\n")
    chat = "/v1/chat/completions"
    assert not _has_output(chat, role) and _has_output(chat, token) and not _has_output(chat, busy)
    assert _has_output("/v1/responses", b'event: response.output_item.added\ndata: {}\n\n')
    assert not _has_output("/v1/responses", b'event: response.created\ndata: {}\n\n')
    assert _has_output("/v1/messages", b'event: content_block_start\ndata: {}\n\n')
    assert not _has_output("/v1/messages", b'event: message_start\ndata: {}\n\n')
    assert _is_moving_busy(200, role + busy) and _is_moving_busy(409, busy)
    assert not _is_moving_busy(409, b'{"error": {"message": "already has a turn running", "code": "session_busy"}}')
    assert not _is_moving_busy(500, busy)


def test_route_keys_of_responses_and_messages(ingress: Ingress, tiny_llama: Path) -> None:
    from sessionserve.server.response_store import StoredResponse
    from sessionserve.server.turn.types import Continuation, SessionPoint

    headers = {"x-api-key": "key-a", "x-claude-code-session-id": "cc-1"}
    body = {"model": "m", "max_tokens": 8, "system": "Be brief. " * 30,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    req = ingress.route_of("POST", "/v1/messages", headers, json.dumps(body).encode())
    # Claude Code's session header keeps the conversation on one replica; the store keeps no record of it.
    assert req.tenant == "alice" and req.route.session_key == "alice/cc-1" and req.session_key is None
    prompt = render_chat(Tokenizer(tiny_llama), [{"role": "system", "content": body["system"]},
                                                 {"role": "user", "content": "hi"}], None)
    assert req.route.block_hashes == tuple(extend_block_hashes([], prompt, 16, salt=tenant_salt("alice")))
    # A stored response sends the next turn where its session is.
    point = SessionPoint("alice/~abc", 40, 1, "d", "<|im_end|>")
    ingress.responses.put(StoredResponse("resp_1", "alice", {}, [], [{"role": "user", "content": "hi"},
                                                                      {"role": "assistant", "content": "yo"}],
                                         continuation=Continuation(point, "digest")))
    nxt = ingress.route_of("POST", "/v1/responses", {"authorization": "Bearer key-a"},
                           json.dumps({"model": "m", "input": "more", "previous_response_id": "resp_1"}).encode())
    assert nxt.route.session_key == "alice/~abc"
    codex = ingress.route_of("POST", "/v1/responses", {"authorization": "Bearer key-a"},
                             json.dumps({"model": "m", "input": "x " * 40, "prompt_cache_key": "thread-9"}).encode())
    assert codex.route.session_key == "alice/thread-9" and len(codex.route.block_hashes) >= 1
