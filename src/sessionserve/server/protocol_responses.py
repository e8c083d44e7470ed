"""Builders for OpenAI response bodies: chat completions and their stream chunks, legacy
completions and their chunks, usage, log-probabilities, and the model list.

Plain dicts shaped exactly like OpenAI's (the unit tests parse them with the
official `openai` client's types). We serve one choice per request (n=1), so
builders take that choice's fields directly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# JSON has no -inf; OpenAI reports impossible tokens with this floor instead.
LOGPROB_FLOOR = -9999.0


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI `usage`; `cached_tokens` counts prompt tokens whose KV was reused (session / prefix hits)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's log-probability and the top alternatives at that position.

    `token_bytes` are the token's raw UTF-8 bytes when `token` alone cannot
    carry them (a token that ends inside a multi-byte character).
    """

    token: str
    logprob: float
    top: Sequence[TokenLogprob] = field(default_factory=tuple)
    token_bytes: bytes | None = None

    def raw_bytes(self) -> list[int]:
        return list(self.token_bytes if self.token_bytes is not None else self.token.encode("utf-8"))


def chat_logprobs(entries: Iterable[TokenLogprob]) -> dict[str, Any]:
    """Chat `choices[i].logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}`."""
    content = [
        {
            "token": e.token,
            "logprob": _finite(e.logprob),
            "bytes": e.raw_bytes(),
            "top_logprobs": [{"token": t.token, "logprob": _finite(t.logprob), "bytes": t.raw_bytes()}
                             for t in e.top],
        }
        for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Iterable[TokenLogprob], text_offset_start: int = 0) -> dict[str, Any]:
    """Legacy completion `logprobs`: parallel lists, `top_logprobs` as token -> logprob maps."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []
    offset = text_offset_start
    for e in entries:
        tokens.append(e.token)
        token_logprobs.append(_finite(e.logprob))
        top_logprobs.append({t.token: _finite(t.logprob) for t in e.top})
        text_offset.append(offset)
        offset += len(e.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


Logprobs = dict[str, Any] | Sequence[TokenLogprob] | None


def _chat_lp(logprobs: Logprobs) -> dict[str, Any] | None:
    # Callers may pass entries, or a body they built already.
    return logprobs if logprobs is None or isinstance(logprobs, dict) else chat_logprobs(logprobs)


def _completion_lp(logprobs: Logprobs) -> dict[str, Any] | None:
    return logprobs if logprobs is None or isinstance(logprobs, dict) else completion_logprobs(logprobs)


def chat_completion(id: str, created: int, model: str, content: str | None,
                    tool_calls: list[dict[str, Any]] | None, finish_reason: str, usage: dict[str, Any], *,
                    logprobs: Logprobs = None, system_fingerprint: str | None = None) -> dict[str, Any]:
    """Body of a non-streaming chat completion (`object: "chat.completion"`), one choice."""
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice = {"index": 0, "message": message, "logprobs": _chat_lp(logprobs), "finish_reason": finish_reason}
    return {"id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], "usage": usage, "system_fingerprint": system_fingerprint}


def chat_chunk(id: str, created: int, model: str, delta: dict[str, Any] | None, *,
               finish_reason: str | None = None, logprobs: Logprobs = None,
               usage: dict[str, Any] | None = None, system_fingerprint: str | None = None) -> dict[str, Any]:
    """One `chat.completion.chunk`.

    `delta` holds any of `role`, `content`, `tool_calls` (each tool-call
    delta with its `index`); the last content chunk has `{}` and the
    finish_reason. `delta=None` with `usage` is the usage-only chunk that
    stream_options.include_usage asks for: `choices: []`.
    """
    chunk: dict[str, Any] = {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                             "system_fingerprint": system_fingerprint}
    if delta is None:
        chunk["choices"] = []
    else:
        chunk["choices"] = [{"index": 0, "delta": delta, "logprobs": _chat_lp(logprobs),
                             "finish_reason": finish_reason}]
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def completion(id: str, created: int, model: str, text: str, finish_reason: str, usage: dict[str, Any], *,
               logprobs: Logprobs = None, system_fingerprint: str | None = None,
               token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
    """Body of a legacy completion (`object: "text_completion"`), one choice; ids only when given."""
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": _completion_lp(logprobs),
                              "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    return {"id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": usage, "system_fingerprint": system_fingerprint}


def completion_chunk(id: str, created: int, model: str, text: str | None, finish_reason: str | None = None, *,
                     logprobs: Logprobs = None, usage: dict[str, Any] | None = None,
                     system_fingerprint: str | None = None, token_ids: list[int] | None = None) -> dict[str, Any]:
    """One streamed legacy completion chunk (OpenAI keeps `object: "text_completion"` for these).

    `text=None` and no finish_reason, with `usage`: the usage-only chunk, `choices: []`.
    """
    chunk: dict[str, Any] = {"id": id, "object": "text_completion", "created": created, "model": model,
                             "system_fingerprint": system_fingerprint}
    if text is None and finish_reason is None:
        chunk["choices"] = []
    else:
        chunk["choices"] = [{"index": 0, "text": text or "", "logprobs": _completion_lp(logprobs),
                             "finish_reason": finish_reason}]
        if token_ids is not None:
            chunk["choices"][0]["token_ids"] = token_ids
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def model_card(model_id: str, created: int, owned_by: str = "sessionserve") -> dict[str, Any]:
    """One entry of GET /v1/models (and the body of GET /v1/models/{id})."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}

