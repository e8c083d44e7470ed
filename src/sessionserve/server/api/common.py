"""What the adapters share: SSE framing, token log-probabilities, request priority."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fastapi import Request

from sessionserve.server import protocol as P

if TYPE_CHECKING:
    from sessionserve.llm_engine import RequestOutput
    from sessionserve.model.tokenizer import Tokenizer


def sse(obj: dict[str, Any], event: str | None = None) -> str:
    """One server-sent event: `data: <json>` (after `event: <name>` when given), on single lines."""
    data = json.dumps(obj, ensure_ascii=False)
    return f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n"


def request_priority(request: Request, field: str | None) -> str | None:
    """The body's `priority`, else the `X-Priority` header; None: the session's (or interactive)."""
    value = field or request.headers.get("x-priority")
    if value is not None and value not in ("interactive", "batch"):
        raise P.OpenAIError(400, "priority must be 'interactive' or 'batch'.", "invalid_request_error",
                            param="priority")
    return value


def token_logprobs(tok: Tokenizer, out: RequestOutput, last: int | None = None) -> list[P.TokenLogprob]:
    """Log-probabilities of the output's tokens (the `last` ones only when given), with their top alternatives."""
    rows = out.outputs[0].logprobs or []
    ids = out.token_ids
    if last is not None:
        ids, rows = ids[len(ids) - last:], rows[len(rows) - last:] if last else []
    entries = []
    for token_id, row in zip(ids, rows):
        top = tuple(P.TokenLogprob(tok.decode([t], skip_special_tokens=False), lp)
                    for t, lp in sorted(row.items(), key=lambda kv: -kv[1]))
        text = tok.decode([token_id], skip_special_tokens=False)
        entries.append(P.TokenLogprob(text, row.get(token_id, float("-inf")), top=top))
    return entries
