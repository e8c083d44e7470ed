"""ChatClient: plain and streamed chat, HTTP retries under the budget, Retry-After, session detection."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from sessionserve.agent.client import ChatClient, ModelError
from sessionserve.agent.retry import Backoff, RetryBudget

FAST = Backoff(base_s=0.001, max_s=0.002, max_attempts=4)


def mock_client(handler: Callable[[httpx.Request], httpx.Response], budget: RetryBudget | None = None,
                **kw: Any) -> ChatClient:
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return ChatClient("http://model.test/v1", "sk-test", model="m", budget=budget or RetryBudget(),
                      backoff=kw.pop("backoff", FAST), http=http, rng=random.Random(0), **kw)


def ok_body(content: str = "hi") -> dict[str, Any]:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 2}}}


def test_plain_endpoint_gets_plain_requests_and_no_sessions(fake: tuple[str, FastAPI]) -> None:
    url, app = fake

    async def main() -> None:
        client = ChatClient(url, "sk", budget=RetryBudget())
        assert await client.open_session() is None and client.has_sessions is False
        assert await client.probe_sessions() is False
        script = json.dumps({"steps": [[{"name": "t", "arguments": {"x": 1}}]]})
        tools = [{"type": "function", "function": {"name": "t", "parameters": {"type": "object"}}}]
        n0 = len(app.state.requests)
        reply = await client.chat([{"role": "user", "content": script}], tools=tools, tool_choice="auto",
                                  max_tokens=10)
        assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("t", {"x": 1})]
        assert reply.finish_reason == "tool_calls"
        assert reply.message()["tool_calls"][0]["id"] == reply.tool_calls[0].call_id
        headers, body = app.state.requests[n0]
        assert "x-session-id" not in headers and headers["authorization"] == "Bearer sk"
        assert set(body) == {"model", "messages", "tools", "tool_choice", "max_tokens"}
        await client.aclose()

    asyncio.run(main())


def test_streaming_assembles_text_and_tool_calls(fake: tuple[str, FastAPI]) -> None:
    url, _ = fake

    async def main() -> None:
        client = ChatClient(url, "sk", budget=RetryBudget())
        pieces: list[str] = []
        reply = await client.chat([{"role": "user", "content": "hello"}], stream=True, on_text=pieces.append)
        assert reply.content == "".join(pieces) and reply.content.startswith("done")
        assert reply.usage["completion_tokens"] == 5 and len(pieces) > 1
        script = json.dumps({"steps": [[{"name": "a", "arguments": {"q": "x" * 30}}, {"name": "b"}]]})
        tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in "ab"]
        reply = await client.chat([{"role": "user", "content": script}], tools=tools, stream=True)
        assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("a", {"q": "x" * 30}), ("b", {})]
        assert reply.content is None and reply.finish_reason == "tool_calls"
        await client.aclose()

    asyncio.run(main())


def test_retries_5xx_honouring_retry_after_and_drawing_from_the_budget() -> None:
    seen: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(time.monotonic())
        if len(seen) < 3:
            return httpx.Response(503, json={"error": {"message": "busy"}}, headers={"Retry-After": "0.05"})
        return httpx.Response(200, json=ok_body())

    budget = RetryBudget()

    async def main() -> None:
        client = mock_client(handler, budget)
        reply = await client.chat([{"role": "user", "content": "x"}])
        assert reply.content == "hi" and reply.num_attempts == 3 and reply.num_cached_tokens == 2

    asyncio.run(main())
    assert seen[1] - seen[0] >= 0.05 and seen[2] - seen[1] >= 0.05
    assert budget.num_requests == 1 and budget.num_retries == 2


@pytest.mark.parametrize("status, headers", [(400, {}), (404, {}), (429, {"Retry-After": "120"})])
def test_not_retried_client_errors_and_too_long_retry_after(status: int, headers: dict[str, str]) -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(status, json={"error": {"message": "nope"}}, headers=headers)

    async def main() -> None:
        with pytest.raises(ModelError) as info:
            await mock_client(handler).chat([{"role": "user", "content": "x"}])
        assert info.value.status == status and "nope" in str(info.value)

    asyncio.run(main())
    assert len(calls) == 1


def test_spent_budget_stops_http_retries_and_is_shared_with_other_layers() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(503, json={"error": {"message": "down"}})

    budget = RetryBudget(ratio=0.0, min_retries_per_s=0.1, window_s=10.0)  # one retry per window
    assert budget.try_acquire_retry(time.monotonic())  # another layer (a tool) spent it

    async def main() -> None:
        with pytest.raises(ModelError):
            await mock_client(handler, budget).chat([{"role": "user", "content": "x"}])

    asyncio.run(main())
    assert len(calls) == 1 and budget.num_denied == 1


def test_connection_errors_are_retried() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) == 1:
            raise httpx.ConnectError("refused")
        return httpx.Response(200, json=ok_body())

    async def main() -> None:
        reply = await mock_client(handler).chat([{"role": "user", "content": "x"}], is_retry=True)
        assert reply.num_attempts == 2

    asyncio.run(main())


def test_stream_that_failed_after_text_is_not_retried() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        chunk = {"choices": [{"index": 0, "delta": {"content": "par"}, "finish_reason": None}]}
        text = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps({'error': {'message': 'engine died'}})}\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    async def main() -> None:
        shown: list[str] = []
        with pytest.raises(ModelError, match="engine died"):
            await mock_client(handler).chat([{"role": "user", "content": "x"}], stream=True, on_text=shown.append)
        assert shown == ["par"]

    asyncio.run(main())
    assert len(calls) == 1


def sessionserve_like(log: list[tuple[str, str, dict[str, Any]]],
                      create_status: int = 200) -> Callable[[httpx.Request], httpx.Response]:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        log.append((request.method, request.url.path, {"headers": dict(request.headers), "body": body}))
        if request.url.path == "/v1/sessions" and request.method == "POST":
            if create_status != 200:
                return httpx.Response(create_status, json={"error": {"message": "x"}})
            return httpx.Response(200, json={"id": body["session_id"], "object": "session", "state": "idle"})
        if request.url.path.startswith("/v1/sessions/"):
            return httpx.Response(200, json={"deleted": True})
        return httpx.Response(200, json=ok_body())
    return handler


def test_sessions_detected_and_sent_with_hints() -> None:
    log: list[tuple[str, str, dict[str, Any]]] = []

    async def main() -> None:
        client = mock_client(sessionserve_like(log))
        assert await client.probe_sessions() is True
        assert [(m, p) for m, p, _ in log] == [("POST", "/v1/sessions"), ("DELETE", log[1][1])]
        sid = await client.open_session(priority="batch")
        assert sid and client.has_sessions and log[-1][2]["body"]["priority"] == "batch"
        tools = [{"type": "function", "function": {"name": "t", "parameters": {"type": "object"}}}]
        await client.chat([{"role": "user", "content": "x"}], tools=tools, session_id=sid, expected_wait_s=1.23456,
                          priority="batch")
        sent = log[-1][2]
        assert sent["headers"]["x-session-id"] == sid
        assert sent["body"]["expected_wait_s"] == 1.235 and sent["body"]["priority"] == "batch"
        assert "session_id" not in sent["body"]

    asyncio.run(main())


@pytest.mark.parametrize("status, cached", [(404, False), (405, False), (500, None), (503, None)])
def test_session_detection_caches_only_clear_answers(status: int, cached: bool | None) -> None:
    log: list[tuple[str, str, dict[str, Any]]] = []

    async def main() -> None:
        client = mock_client(sessionserve_like(log, create_status=status))
        assert await client.open_session() is None
        assert client.has_sessions is cached
        await client.open_session()

    asyncio.run(main())
    assert len(log) == (1 if cached is False else 2)


def test_bad_key_is_an_error_not_a_missing_feature() -> None:
    async def main() -> None:
        with pytest.raises(ModelError) as info:
            await mock_client(sessionserve_like([], create_status=401)).open_session()
        assert info.value.status == 401

    asyncio.run(main())
