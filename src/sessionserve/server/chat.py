"""Chat requests to prompt tokens, and continuing a session from the messages a client sends.

A client of an OpenAI-style API resends the whole conversation every call.
With a session, the server keeps what it computed: the rendered prompt is
matched against the session's token history, and only the part after the
longest common prefix is sent to the engine. When the client did not rewrite
anything that is just the new messages; when it did (or when re-tokenizing
the model's own output differs from what it generated), the session is cut
back to the common prefix first, never past it.
"""

from __future__ import annotations

from typing import Any

from sessionserve.llm_engine import LLMEngine
from sessionserve.model.tokenizer import Tokenizer


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages to what the chat template expects (developer -> system, tool-call args as given)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "developer":
            m["role"] = "system"
        if m.get("tool_calls"):
            m["tool_calls"] = [dict(tc) for tc in m["tool_calls"]]
        out.append(m)
    return out


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """The prompt tokens for a chat request, ending with the assistant header."""
    tool_specs = [t.get("function", t) for t in tools] if tools else None
    text = tokenizer.apply_chat_template(normalize_messages(messages), tools=tool_specs, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def continue_session(eng: LLMEngine, session_id: str, prompt: list[int], tenant: str,
                     priority: str = "interactive") -> tuple[list[int], int]:
    """Prepare `session_id` (opened on first use) for a turn whose full prompt is `prompt`.

    Runs in the engine thread. Returns (new tokens to send, tokens reused).
    """
    session = eng.get_session(session_id)
    if session is None:
        eng.open_session(session_id, tenant=tenant, priority=priority)
        return prompt, 0
    if session.tenant != tenant:
        raise PermissionError("session belongs to another tenant")
    history = session.token_ids
    lcp = common_prefix_len(history, prompt)
    if lcp == len(prompt):
        lcp -= 1  # at least one token must be computed to get logits for the next one
    if lcp < len(history):
        eng.sessions.truncate(session, lcp)
    return prompt[lcp:], lcp
