"""Session routes: POST /v1/sessions, GET/DELETE /v1/sessions/{id}, POST /v1/sessions/{id}/fork.

Sessions are namespaced by tenant: another tenant's session id is simply not
found (404), whether it exists or not. Ids here are taken strictly (a 400 for
one the server cannot use, `.` and `..` included); a turn's id that the server
mapped (turn/identity.py) is valid, and its response names it in `x-session-id`.

A server with several models keeps a copy of a session in each engine that
ran one of its steps: a session is created in the default model's engine (the
others open theirs at its first step there), read from the engine that ran
its latest step, and forked or deleted in every engine that holds it.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from sessionserve.llm_engine import LLMEngine
from sessionserve.server import protocol as P
from sessionserve.server.app import read_body, read_json
from sessionserve.server.protocol_common import openapi_route
from sessionserve.server.turn.identity import session_key
from sessionserve.server.turn.pipeline import check_session_limit

if TYPE_CHECKING:
    from sessionserve.server.bridge import Session
    from sessionserve.server.app import ModelSlot, ServerState


def session_object(session: Session, public_id: str) -> dict[str, Any]:
    return {
        "id": public_id, "object": "session", "created": int(session.opened_s), "state": session.state.value,
        "priority": session.priority, "num_tokens": len(session.token_ids),
        "num_computed_tokens": session.num_computed_tokens, "residency": session.residency.value,
        "waiting_tools": list(session.waiting_tools), "steps": session.stats.num_turns,
        "stats": asdict(session.stats),
    }


# Body of POST /v1/sessions and POST /v1/sessions/{id}/fork (both optional).
SESSION_BODY_SCHEMA = {"type": "object", "properties": {
    "session_id": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$", "not": {"enum": [".", ".."]}},
    "priority": {"type": "string", "enum": ["interactive", "batch"]}}}


def bad_body_id() -> P.OpenAIError:
    return P.OpenAIError(400, "session_id must be 1-128 characters of [A-Za-z0-9._:-], not '.' or '..'.",
                         "invalid_request_error", param="session_id")


def check_path_id(sid: str) -> None:
    """A 400 for `.` and `..`: never session ids, whatever a client or proxy makes of them in a URL."""
    if sid in (".", ".."):
        raise P.OpenAIError(400, f"'{sid}' is not a session id.", "invalid_request_error", param="session_id")


def register(app: FastAPI, state: ServerState) -> None:
    bridge = state.bridge
    slots = list(state.models.values())

    async def holders(key: str, public_id: str) -> list[tuple[ModelSlot, dict[str, Any], float]]:
        """The models whose engines hold session `key`: (model, its copy as JSON, when that copy last ran)."""
        def look(eng: LLMEngine) -> tuple[dict[str, Any], float] | None:
            session = eng.get_session(key)
            return None if session is None else (session_object(session, public_id), session.last_active_s)

        found = []
        for slot in slots:
            copy = await slot.bridge.call(look)
            if copy is not None:
                found.append((slot, *copy))
        return found

    def not_found(sid: str) -> P.OpenAIError:
        return P.OpenAIError(404, f"Session '{sid}' not found.", "not_found_error", param="session_id")

    @app.post("/v1/sessions", **openapi_route(SESSION_BODY_SCHEMA, is_body_required=False))
    async def create_session(request: Request) -> Any:
        body = await read_json(request) if await read_body(request) else {}
        sid = body.get("session_id") or f"sess_{uuid.uuid4().hex}"
        priority = body.get("priority", "interactive")
        if not isinstance(sid, str) or not P.valid_session_id(sid):
            raise bad_body_id()
        if priority not in ("interactive", "batch"):
            raise P.OpenAIError(400, "priority must be 'interactive' or 'batch'.", "invalid_request_error",
                                param="priority")
        tenant = request.state.tenant
        key = session_key(tenant, sid)

        def do(eng: LLMEngine) -> dict[str, Any]:
            if eng.get_session(key) is not None:
                raise P.OpenAIError(409, f"Session '{sid}' already exists.", "invalid_request_error",
                                    param="session_id", code="session_exists")
            check_session_limit(eng, tenant, state.config.max_sessions_per_tenant)
            eng.open_session(key, tenant=tenant, priority=priority)
            return session_object(eng.get_session(key), sid)

        return await bridge.call(do)

    @app.post("/v1/sessions/{sid}/fork", **openapi_route(SESSION_BODY_SCHEMA, is_body_required=False))
    async def fork_session(sid: str, request: Request) -> Any:
        """A new session starting from `sid`'s history; both go on independently (sub-agents)."""
        check_path_id(sid)
        body = await read_json(request) if await read_body(request) else {}
        child = body.get("session_id") or f"sess_{uuid.uuid4().hex}"
        if not isinstance(child, str) or not P.valid_session_id(child):
            raise bad_body_id()
        tenant = request.state.tenant
        key, child_key = session_key(tenant, sid), session_key(tenant, child)

        def do(eng: LLMEngine) -> dict[str, Any]:
            if eng.get_session(child_key) is not None:
                raise P.OpenAIError(409, f"Session '{child}' already exists.", "invalid_request_error",
                                    param="session_id", code="session_exists")
            check_session_limit(eng, tenant, state.config.max_sessions_per_tenant)
            eng.fork_session(key, child_key)
            return {**session_object(eng.get_session(child_key), child), "forked_from": sid}

        found = await holders(key, sid)
        if not found:
            raise not_found(sid)
        if await holders(child_key, child):  # checked in every engine first: no half-made fork
            raise P.OpenAIError(409, f"Session '{child}' already exists.", "invalid_request_error",
                                param="session_id", code="session_exists")
        results = [await slot.bridge.call(do) for slot, _, _ in found]
        return results[0]

    @app.get("/v1/sessions/{sid}", **openapi_route())
    async def get_session(sid: str, request: Request) -> Any:
        check_path_id(sid)
        found = await holders(session_key(request.state.tenant, sid), sid)
        if not found:
            raise not_found(sid)
        slot, body, _ = max(found, key=lambda f: f[2])
        if len(slots) > 1:
            body["model"] = slot.name
            body["models"] = [s.name for s, _, _ in found]
        return body

    @app.delete("/v1/sessions/{sid}", **openapi_route())
    async def delete_session(sid: str, request: Request) -> Any:
        check_path_id(sid)
        key = session_key(request.state.tenant, sid)
        found = await holders(key, sid)
        if not found:
            raise not_found(sid)
        for slot, _, _ in found:
            await slot.bridge.call(lambda e: e.close_session(key) if e.get_session(key) is not None else None)
        return {"id": sid, "object": "session.deleted", "deleted": True}
