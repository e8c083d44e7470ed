"""What a router in front of several servers needs from a request, worked out as the server itself would.

For each protocol the same adapters map the body to chat messages, so a
router hashes the prompt a replica will compute (its prefix-cache blocks) and
keeps a conversation where its KV is: by the session the client names, by the
conversation id it sends (Codex's `prompt_cache_key`, Claude Code's session
header), or by the session a stored response continues.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sessionserve.server.turn.identity import session_hint, session_key
from sessionserve.server.turn.render import render_chat

if TYPE_CHECKING:
    from sessionserve.model.tokenizer import Tokenizer
    from sessionserve.server.response_store import ResponseStore

TURN_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


@dataclass(frozen=True)
class RouteHint:
    session_key: str | None = None  # the session the client named ("tenant/id"): the session store's key
    affinity_key: str | None = None  # what keeps the conversation on one replica
    messages: tuple[dict[str, Any], ...] = ()  # the request's conversation, chat-shaped
    prompt: list[int] = field(default_factory=list)  # its prompt tokens (prefix-cache hashes)


def route_hint(path: str, headers: Mapping[str, str], data: dict[str, Any], tokenizer: Tokenizer, tenant: str,
               responses: ResponseStore | None = None) -> RouteHint:
    """The hint for a generation request at `path`. Raises (any error) for a body the server would refuse."""
    from sessionserve.server.api import messages as anthropic
    from sessionserve.server.api import responses_request as openai_responses

    previous = None
    messages: list[dict[str, Any]] = []
    tools = None
    prompt: list[int] = []
    cache_key = user_id = None
    if path == "/v1/chat/completions":
        messages, tools = list(data.get("messages") or ()), data.get("tools")
        cache_key = data.get("prompt_cache_key")
    elif path == "/v1/completions":
        p = data.get("prompt")
        prompt = tokenizer.encode(p) if isinstance(p, str) else list(p or [])
    elif path == "/v1/responses":
        if data.get("previous_response_id") and responses is not None:
            record = responses.get(tenant, data["previous_response_id"])
            previous = record.continuation if record is not None else None
            messages = (responses.conversation(record) or []) if record is not None else []
        if data.get("instructions"):
            messages.insert(0, {"role": "system", "content": data["instructions"]})
        messages += openai_responses.input_messages(data.get("input"))
        tools = openai_responses.function_tools(data.get("tools")) or None
        cache_key = data.get("prompt_cache_key")
    elif path == "/v1/messages":
        messages = anthropic.system_messages(data.get("system")) + anthropic.chat_messages(data.get("messages") or [])
        tools = anthropic.offered_tools(data.get("tools"))
        user_id = (data.get("metadata") or {}).get("user_id")
    hint = session_hint(headers, body_session_id=data.get("session_id"), prompt_cache_key=cache_key,
                        user_id=user_id, previous=previous)
    if messages:
        prompt = render_chat(tokenizer, messages, tools)
    explicit = session_key(tenant, hint.explicit) if hint.explicit else None
    affinity = explicit or (previous.point.key if previous is not None else
                            session_key(tenant, hint.group) if hint.group else None)
    return RouteHint(explicit, affinity, tuple(messages), prompt)
