"""Which session a turn belongs to, from what the clients already send.

In this order:

1. `previous_response_id` (Responses): the stored response names the session
   and the point in it; the turn continues there (a fork if the session has
   moved on since).
2. `X-Session-ID` header or body `session_id`: the client names its session.
   The server keeps it as named: a second turn while one runs is a 409. An
   id the server cannot use as sent (`trace_0100#0`) is mapped to one it can,
   the same one every time (protocol_common.client_session_id); one that
   cannot name a session (empty, control characters, too long) is ignored,
   as servers that do not know the header ignore it. The response says which
   (`x-session-id`: the id used; `x-sessionserve-warning`: why one was
   ignored), through the request's `SessionIdNotice`.
3. A conversation id the client sends for caching: Codex's `prompt_cache_key`
   and `session-id` / `thread-id` headers, Claude Code's
   `X-Claude-Code-Session-Id` and `metadata.user_id` (a JSON string with
   `session_id`). These group a client's conversations (sub-agents and
   side requests share them), so the turn joins the conversation of the
   group it extends, and requests that run at the same time fork it.
4. Nothing: the conversation is found from its content (implicit sessions).

Group ids only steer: any printable string is accepted, and one that is not
a valid session id is hashed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from sessionserve.server import protocol as P
from sessionserve.server.protocol_common import client_session_id
from sessionserve.server.turn.types import Continuation, SessionHint

SESSION_HEADER = "x-session-id"
GROUP_HEADERS = ("x-claude-code-session-id", "session-id", "session_id", "thread-id", "conversation-id")
MAX_GROUP_ID_CHARS = 512


@dataclass(slots=True)
class SessionIdNotice:
    """What became of the session id a request named, for its response headers."""

    session_id: str | None = None  # the id the turn runs under (as sent, or mapped)
    warning: str | None = None  # why an id the client sent was ignored


# NOTE: the HTTP middleware sets a fresh notice per request and writes it into the response headers; the
# route's task sees the same object (a context copy keeps the reference). Unset (None) outside a request,
# e.g. when a router works out a route hint.
session_id_notice: ContextVar[SessionIdNotice | None] = ContextVar("session_id_notice", default=None)


def session_key(tenant: str, session_id: str) -> str:
    """Engine-side session id: namespaced by tenant, so tenants never see each other's sessions."""
    return f"{tenant}/{session_id}"


def explicit_session_id(headers: Mapping[str, str], body_sid: str | None) -> str | None:
    """The session the client names (the header's, else the body's), mapped to one the server can use;
    None if it names none. Never an error: an id that cannot name a session is ignored, with a warning
    in the request's `session_id_notice`."""
    notice = session_id_notice.get()
    sid, problems = None, []
    for where, raw in (("X-Session-ID", headers.get(SESSION_HEADER)), ("session_id", body_sid)):
        if isinstance(raw, str):
            sid, problem = client_session_id(raw)
            if sid is not None:
                break
            problems.append(f"session id ignored ({where}): {problem}")
    if notice is not None:
        notice.session_id = sid
        notice.warning = "; ".join(problems) or None
    return sid


def _user_id_session(user_id: Any) -> str | None:
    """Claude Code's `metadata.user_id`: a JSON string whose `session_id` names the CLI session."""
    if not isinstance(user_id, str) or not user_id.startswith("{"):
        return None
    try:
        value = json.loads(user_id)
    except (ValueError, RecursionError):  # RecursionError: nested past Python's limit
        return None
    sid = value.get("session_id") if isinstance(value, dict) else None
    return sid if isinstance(sid, str) and sid else None


def _group_id(value: str) -> str | None:
    value = value.strip()
    if not value or len(value) > MAX_GROUP_ID_CHARS or not value.isprintable():
        return None
    return value if P.valid_session_id(value) else "h-" + hashlib.sha256(value.encode()).hexdigest()[:32]


def session_hint(headers: Mapping[str, str], *, body_session_id: str | None = None,
                 prompt_cache_key: Any = None, user_id: Any = None,
                 previous: Continuation | None = None) -> SessionHint:
    """The session hint of a request, in the order the module docstring gives."""
    if previous is not None:
        return SessionHint(previous=previous, source="previous_response_id")
    sid = explicit_session_id(headers, body_session_id)
    if sid is not None:
        return SessionHint(explicit=sid, source="session_id")
    candidates: list[tuple[str, Any]] = [("prompt_cache_key", prompt_cache_key)]
    candidates += [(h, headers.get(h)) for h in GROUP_HEADERS]
    candidates.append(("metadata.user_id", _user_id_session(user_id)))
    for source, value in candidates:
        if isinstance(value, str):
            group = _group_id(value)
            if group is not None:
                return SessionHint(group=group, source=source)
    return SessionHint()
