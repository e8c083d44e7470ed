"""A plain OpenAI-compatible chat endpoint with a scripted model, for tests and benchmarks.

It answers instantly (or after `latency_s`) and knows nothing of sessions:
`/v1/sessions` does not exist, and with `is_strict` it rejects body fields
OpenAI does not know, as OpenAI does. The "model" follows a script in the
first user message:

    {"steps": [[{"name": "add", "arguments": {"a": 1}}, ...], ...]}

step i (counted by assistant turns so far) asks for the calls of steps[i];
once the script is done, or when tool_choice is "none", it answers with
text. When a tool result starts with "ERROR" it re-plans: it asks for the
failed calls again, as a model retrying a failed tool would. A plain
message that is not a script gets a text answer.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

OPENAI_CHAT_FIELDS = frozenset({
    "model", "messages", "tools", "tool_choice", "parallel_tool_calls", "stream", "stream_options", "max_tokens",
    "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
    "logit_bias", "logprobs", "top_logprobs", "user", "response_format", "metadata", "store", "service_tier",
})


@dataclass(frozen=True)
class FakeModelConfig:
    is_strict: bool = True  # 400 on body fields OpenAI does not know (e.g. expected_wait_s)
    latency_s: float = 0.0  # per chat request
    fail_rate: float = 0.0  # share of chat requests answered with `fail_status`
    fail_status: int = 503
    retry_after_s: float | None = None  # sent as Retry-After with failures
    seed: int = 0


def _script(messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]] | None:
    first = next((m for m in messages if m.get("role") == "user"), None)
    try:
        script = json.loads(first["content"]) if first else None
    except (TypeError, json.JSONDecodeError):
        return None
    return script.get("steps") if isinstance(script, dict) else None


def plan_reply(body: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]]]:
    """The scripted model: (text, tool calls) for a chat request body."""
    messages = body.get("messages") or []
    steps = _script(messages)
    if steps is None or not body.get("tools") or body.get("tool_choice") == "none":
        return f"done after {sum(1 for m in messages if m.get('role') == 'tool')} tool results", []
    # Re-plan: repeat the calls whose results were errors.
    if messages and messages[-1].get("role") == "tool":
        tail = []
        for m in reversed(messages):
            if m.get("role") != "tool":
                break
            tail.append(m)
        asked = {tc["id"]: tc for tc in messages[-len(tail) - 1].get("tool_calls") or []}
        failed = [asked[m["tool_call_id"]] for m in reversed(tail)
                  if str(m.get("content", "")).startswith("ERROR") and m.get("tool_call_id") in asked]
        if failed:
            return None, [{"name": tc["function"]["name"], "arguments": json.loads(tc["function"]["arguments"])}
                          for tc in failed]
    # A script step is done when a turn's calls all succeeded (a re-plan finishes the step it repeats).
    step = sum(1 for i, m in enumerate(messages) if m.get("role") == "assistant" and m.get("tool_calls")
               and not any(str(r.get("content", "")).startswith("ERROR")
                           for r in messages[i + 1:i + 1 + len(m["tool_calls"])]))
    if step < len(steps):
        return None, list(steps[step])
    return "done", []


def make_app(config: FakeModelConfig | None = None) -> FastAPI:
    """The FastAPI app. `app.state.requests` keeps every chat request as (headers, body)."""
    cfg = config or FakeModelConfig()
    app = FastAPI()
    app.state.requests = []
    rng = random.Random(cfg.seed)

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "test"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        app.state.requests.append((dict(request.headers), body))
        unknown = sorted(set(body) - OPENAI_CHAT_FIELDS)
        if cfg.is_strict and unknown:
            return JSONResponse({"error": {"message": f"Unrecognized request argument supplied: {unknown[0]}",
                                           "type": "invalid_request_error", "param": None, "code": None}}, 400)
        if cfg.latency_s:
            await asyncio.sleep(cfg.latency_s)
        if cfg.fail_rate and rng.random() < cfg.fail_rate:
            headers = {"Retry-After": f"{cfg.retry_after_s:g}"} if cfg.retry_after_s is not None else {}
            return JSONResponse({"error": {"message": "overloaded", "type": "server_error"}}, cfg.fail_status,
                                headers=headers)
        text, calls = plan_reply(body)
        tool_calls = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                       "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", {}))}}
                      for c in calls]
        usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
        finish = "tool_calls" if tool_calls else "stop"
        if body.get("stream"):
            return StreamingResponse(_sse(text, tool_calls, finish, usage, body), media_type="text/event-stream")
        message = {"role": "assistant", "content": text, **({"tool_calls": tool_calls} if tool_calls else {})}
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": "fake", "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": usage}

    return app


async def _sse(text: str | None, tool_calls: list[dict[str, Any]], finish: str, usage: dict[str, Any],
               body: dict[str, Any]) -> Any:
    def chunk(delta: dict[str, Any] | None, finish_reason: str | None = None, **extra: Any) -> str:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
        return "data: " + json.dumps({"object": "chat.completion.chunk", "choices": choices, **extra}) + "\n\n"

    yield chunk({"role": "assistant", "content": ""})
    for word in (text or "").split(" ") if text else []:
        yield chunk({"content": word + " "})
    for i, tc in enumerate(tool_calls):
        args = tc["function"]["arguments"]
        half = len(args) // 2
        yield chunk({"tool_calls": [{"index": i, "id": tc["id"], "type": "function",
                                     "function": {"name": tc["function"]["name"], "arguments": args[:half]}}]})
        yield chunk({"tool_calls": [{"index": i, "function": {"arguments": args[half:]}}]})
    yield chunk({}, finish)
    if (body.get("stream_options") or {}).get("include_usage"):
        yield chunk(None, usage=usage)
    yield "data: [DONE]\n\n"


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run `app` under uvicorn on a free 127.0.0.1 port in a thread; yields the base URL (…/v1)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline_s = time.monotonic() + 20
    while True:
        try:
            httpx.get(url + "/v1/models", timeout=1)
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline_s:
                raise RuntimeError("fake endpoint did not start") from None
            time.sleep(0.02)
    try:
        yield url + "/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
