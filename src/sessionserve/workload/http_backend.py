"""`HttpBackend`: the replay's backend on any OpenAI-compatible server (ours or a peer).

Each step is a streamed `POST /v1/completions` whose `prompt` is the FULL
token list (the session's history + the new tokens), `max_tokens` with
`ignore_eos` and `temperature: 0`. A server with sessions (`supports_sessions`)
also gets `X-Session-ID` / `session_id` and `POST`/`GET`/`DELETE /v1/sessions`;
any server may reuse the prefix through its own prefix cache.

History: the next prompt must repeat what the server generated. We ask for
the ids (`return_token_ids`, vLLM's extension; ignored elsewhere) and, when a
server does not return them, append stand-in ids of the same length; the
server then re-prefills each step's output tokens, which `num_cached_tokens`
shows. TTFT is the time to the first streamed chunk that carries output.
"""

from __future__ import annotations

import json
import time
from typing import Any

from sessionserve.workload.backend import StepResult
from sessionserve.workload.prompts import PromptBuilder

# Ids below 16,384 exist in every tokenizer we target (our embedded models: 16,384; Llama 2: 32,000;
# Llama 3: 128,256; Qwen: 151,936); the lowest ids, where special tokens sit, are never drawn (prompts.py).
DEFAULT_VOCAB_SIZE = 16_384


class HttpBackend:
    """Talks to `url` (the server root, e.g. http://127.0.0.1:8000)."""

    name = "http"

    def __init__(self, url: str, api_key: str | None = None, supports_sessions: bool = True,
                 model: str | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE, timeout_s: float = 600.0,
                 seed: int = 0) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.supports_sessions = supports_sessions
        self.model = model
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._stand_in = PromptBuilder(vocab_size, seed)
        self._history: dict[str, list[int]] = {}
        self.num_stand_in_steps = 0  # steps whose output ids the server did not return
        self._client: Any = None

    async def start(self) -> None:
        import httpx  # noqa: PLC0415 - only the http backend needs it

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._client = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=self.timeout_s)
        if self.model is None:
            r = await self._client.get("/v1/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def open_session(self, session_id: str, priority: str = "interactive") -> None:
        self._history[session_id] = []
        if self.supports_sessions:
            r = await self._client.post("/v1/sessions", json={"session_id": session_id, "priority": priority})
            r.raise_for_status()

    async def generate(self, session_id: str, step_index: int, new_token_ids: list[int], max_tokens: int,
                       context_kept_tokens: int | None = None) -> StepResult:
        history = self._history[session_id]
        if context_kept_tokens is not None:
            del history[context_kept_tokens:]
        prompt = history + list(new_token_ids)
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                                "return_token_ids": True}
        headers = {}
        if self.supports_sessions:
            body["session_id"] = session_id
            headers["X-Session-ID"] = session_id
        t0 = time.monotonic()
        first_s = last_s = None
        out_ids: list[int] = []
        usage: dict[str, Any] = {}
        async with self._client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise RuntimeError(f"server error: {chunk['error']}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    ids = choice.get("token_ids") or []
                    if choice.get("text") or ids:
                        last_s = time.monotonic()
                        first_s = first_s if first_s is not None else last_s
                    out_ids += ids
        end_s = time.monotonic()
        num_out = int(usage.get("completion_tokens", len(out_ids) or max_tokens))
        if len(out_ids) != num_out:
            out_ids = self._stand_in.output_tokens(session_id, step_index, num_out)
            self.num_stand_in_steps += 1
        history[:] = prompt + out_ids
        cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        tpot = (last_s - first_s) / (num_out - 1) if first_s is not None and last_s is not None and num_out > 1 \
            else None
        return StepResult(out_ids, end_s - t0, None if first_s is None else first_s - t0, tpot,
                          int(usage.get("prompt_tokens", len(prompt))), cached)

    async def park(self, session_id: str, tools: tuple[str, ...], expected_wait_s: float | None) -> None:
        # NOTE: /v1/completions carries no tool calls; our server parks the session when the turn ends.
        return None

    async def close_session(self, session_id: str) -> dict[str, float]:
        self._history.pop(session_id, None)
        if not self.supports_sessions:
            return {}
        stats: dict[str, float] = {}
        r = await self._client.get(f"/v1/sessions/{session_id}")
        if r.status_code == 200:
            stats = {k: v for k, v in (r.json().get("stats") or {}).items() if isinstance(v, (int, float))}
        await self._client.delete(f"/v1/sessions/{session_id}")
        return stats

    def kv_usage(self) -> dict[str, int] | None:
        return None

    def busy_s(self) -> float | None:
        return None
