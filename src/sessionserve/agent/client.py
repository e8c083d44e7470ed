"""The model client: OpenAI chat completions over httpx, with tools, streaming, retries and sessions.

Works against any OpenAI-compatible endpoint. On a sessionserve server it
also opens sessions (`POST /v1/sessions`), sends `X-Session-ID`, the
session's `priority` and `expected_wait_s`, and closes them. Whether the
server has sessions is learnt from the first `POST /v1/sessions` and cached
per client: a plain server answers 404/405 (or 400/422 to an unknown
route), and then no session field is ever sent (OpenAI itself rejects
unknown body fields).

HTTP retries (timeouts, connection errors, 408/429/5xx) back off with
jitter, wait at least what Retry-After asks, and draw from the shared
`RetryBudget`, the same one tools and re-plans draw from.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx

from sessionserve.agent.reply import ModelReply, StreamAssembler, reply_from_json
from sessionserve.agent.retry import Backoff, RetryBudget, parse_retry_after_s, process_budget

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
SESSION_HEADER = "X-Session-ID"


class ModelError(Exception):
    """The endpoint refused or failed a request (after any retries)."""

    def __init__(self, status: int | None, message: str, *, retry_after_s: float | None = None,
                 is_partial: bool = False) -> None:
        super().__init__(f"{status}: {message}" if status is not None else message)
        self.status = status
        self.retry_after_s = retry_after_s
        self.is_partial = is_partial  # a stream failed after text reached the caller

    @property
    def is_retryable(self) -> bool:
        # NOTE: a retried stream would show the caller its text twice.
        return not self.is_partial and (self.status is None or self.status in RETRYABLE_STATUS)


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200]
    err = body.get("error") if isinstance(body, dict) else None
    return str(err.get("message") if isinstance(err, dict) else body)[:500]


class ChatClient:
    """Chat completions for an agent. Share one per endpoint; `aclose()` when done."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str = "default", *,
                 budget: RetryBudget | None = None, backoff: Backoff | None = None, timeout_s: float = 120.0,
                 http: httpx.AsyncClient | None = None, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.budget = budget if budget is not None else process_budget()
        self.backoff = backoff or Backoff(base_s=0.2, max_s=8.0, max_attempts=4)
        self.rng = rng or random.Random()
        self.clock = clock
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = http or httpx.AsyncClient(timeout=timeout_s)
        self._headers = headers
        self._has_sessions: bool | None = None  # None: not probed yet
        self.num_attempts = 0  # HTTP chat attempts, for benchmarks

    async def aclose(self) -> None:
        await self._http.aclose()

    # ----- sessions -------------------------------------------------------------------------------------------

    @property
    def has_sessions(self) -> bool | None:
        """Whether the server has sessions: None until the first `open_session` or `probe_sessions`."""
        return self._has_sessions

    async def open_session(self, session_id: str | None = None, priority: str = "interactive") -> str | None:
        """Open a session on the server; None when the server has no sessions (cached) or could not open one.

        Raises ModelError on 401/403 (a key problem is not a missing feature).
        """
        if self._has_sessions is False:
            return None
        sid = session_id or f"agent-{uuid.uuid4().hex}"
        try:
            resp = await self._http.post(f"{self.base_url}/sessions", headers=self._headers,
                                         json={"session_id": sid, "priority": priority})
        except httpx.HTTPError:
            return None  # NOTE: not cached: the chat call will report an unreachable server properly
        if resp.status_code in (401, 403):
            raise ModelError(resp.status_code, _error_message(resp))
        if resp.status_code == 409 and session_id is not None:
            self._has_sessions = True  # the caller's own session, already open: continue it
            return sid
        if resp.status_code == 200:
            try:
                body = resp.json()
            except ValueError:
                body = None
            if isinstance(body, dict) and body.get("object") == "session" and body.get("id") == sid:
                self._has_sessions = True
                return sid
            self._has_sessions = False  # a 200 that is not a session object: some catch-all route
            return None
        if resp.status_code in (400, 404, 405, 422):
            self._has_sessions = False
        return None

    async def probe_sessions(self) -> bool:
        """Detect (once) whether the server has sessions, by opening and closing a throwaway one."""
        if self._has_sessions is None:
            sid = await self.open_session(f"probe-{uuid.uuid4().hex}")
            if sid is not None:
                await self.close_session(sid)
        return bool(self._has_sessions)

    async def get_session(self, session_id: str) -> dict[str, Any]:
        resp = await self._http.get(f"{self.base_url}/sessions/{session_id}", headers=self._headers)
        if resp.status_code != 200:
            raise ModelError(resp.status_code, _error_message(resp))
        return resp.json()

    async def close_session(self, session_id: str) -> None:
        """Close a session; a session already gone is fine."""
        try:
            await self._http.delete(f"{self.base_url}/sessions/{session_id}", headers=self._headers)
        except httpx.HTTPError:
            pass  # the server drops idle sessions on its own; nothing to do

    # ----- chat ------------------------------------------------------------------------------------------------

    async def chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                   tool_choice: str | dict[str, Any] | None = None, session_id: str | None = None,
                   expected_wait_s: float | None = None, priority: str | None = None, stream: bool = False,
                   on_text: Callable[[str], None] | None = None, is_retry: bool = False,
                   **params: Any) -> ModelReply:
        """One logical chat call, retried over HTTP while the budget allows.

        `is_retry`: the call is itself a retry (a re-plan), already paid for by
        the caller, so it is not counted as a new request. Session fields are
        sent only with `session_id`. A stream that already emitted text is not
        retried (the caller has shown it).
        """
        body: dict[str, Any] = {"model": self.model, "messages": messages, **params}
        if tools:
            body["tools"] = tools
            if tool_choice is not None:
                body["tool_choice"] = tool_choice
        headers = dict(self._headers)
        if session_id is not None:
            headers[SESSION_HEADER] = session_id
            if expected_wait_s is not None and tools:
                body["expected_wait_s"] = round(max(0.0, expected_wait_s), 3)
            if priority is not None:
                body["priority"] = priority
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        if not is_retry:
            self.budget.record_request(self.clock())
        num_failed = 0
        while True:
            self.num_attempts += 1
            try:
                if stream:
                    return await self._stream(body, headers, on_text, num_failed + 1)
                return await self._post(body, headers, num_failed + 1)
            except (ModelError, httpx.TimeoutException, httpx.TransportError) as exc:
                err = exc if isinstance(exc, ModelError) else ModelError(None, f"{type(exc).__name__}: {exc}")
                num_failed += 1
                delay_s = self.backoff.delay_s(num_failed, self.rng, err.retry_after_s) if err.is_retryable else None
                if delay_s is None or not self.budget.try_acquire_retry(self.clock()):
                    raise err from None
                await asyncio.sleep(delay_s)

    async def _post(self, body: dict[str, Any], headers: dict[str, str], num_attempts: int) -> ModelReply:
        resp = await self._http.post(f"{self.base_url}/chat/completions", json=body, headers=headers)
        if resp.status_code != 200:
            raise ModelError(resp.status_code, _error_message(resp),
                             retry_after_s=parse_retry_after_s(dict(resp.headers)))
        return reply_from_json(resp.json(), num_attempts)

    async def _stream(self, body: dict[str, Any], headers: dict[str, str], on_text: Callable[[str], None] | None,
                      num_attempts: int) -> ModelReply:
        asm = StreamAssembler()
        async with self._http.stream("POST", f"{self.base_url}/chat/completions", json=body,
                                     headers=headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise ModelError(resp.status_code, _error_message(resp),
                                 retry_after_s=parse_retry_after_s(dict(resp.headers)))
            try:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:  # an error after the 200: the server's way to fail mid-stream
                        err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
                        raise ModelError(500, str(err.get("message")), is_partial=bool(asm.content))
                    text = asm.feed(chunk)
                    if text and on_text is not None:
                        on_text(text)
            except httpx.HTTPError as exc:
                if not asm.content:
                    raise
                raise ModelError(None, f"{type(exc).__name__}: {exc}", is_partial=True) from None
        return asm.reply(num_attempts)
