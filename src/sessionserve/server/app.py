"""The FastAPI application: auth, errors, health, metrics, models; the OpenAI and session routes.

`create_app(engine, ...)` wires an `LLMEngine` (or several, by served name)
behind async bridges, one engine thread each. With two or more models, the
`auto` model routes each chat step by `ModelRoutePolicy` (plan steps to the
large model, execution steps to the small one). Every error leaves as
OpenAI's error JSON with the right status code.

Each request keeps the client's `X-Request-ID` (when plain) as its visible id
(`request.state.request_id`: the response header, the logs) and gets an
engine request id qualified by its tenant (`request.state.engine_request_id`),
so tenants never share, collide on, or learn of each other's request ids.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from sessionserve.config import ServerConfig
from sessionserve.llm_engine import LLMEngine
from sessionserve.obs.cpu_roles import ENGINE, TOKENIZE, CpuRoles, RoleMeter, RolePool
from sessionserve.obs.metrics import Metrics
from sessionserve.obs.tracing import Tracer, request_id_var
from sessionserve.server.auth import Auth
from sessionserve.server.bridge import AdmissionFull, AsyncEngine, EngineDead, EngineOverloaded, SessionBusyError
from sessionserve.server.implicit import ImplicitSessions
from sessionserve.server.model_route import ModelRoutePolicy
from sessionserve.server.protocol import OpenAIError, format_validation_errors, model_card
from sessionserve.server.response_store import ResponseStore
from sessionserve.server.turn.identity import SessionIdNotice, session_id_notice

logger = logging.getLogger("sessionserve.server")


AUTO_MODEL = "auto"


@dataclass
class ModelSlot:
    """One served model: its engine, the bridge to its engine thread, its implicit-session index."""

    name: str
    engine: LLMEngine
    bridge: AsyncEngine
    implicit: ImplicitSessions | None


@dataclass
class ServerState:
    engine: LLMEngine  # the default model's (the first one)
    bridge: AsyncEngine
    auth: Auth
    metrics: Metrics
    tracer: Tracer
    model_name: str
    created: int
    config: ServerConfig = field(default_factory=ServerConfig)
    # Sessions found from the conversation when a request names none (None: off).
    implicit: ImplicitSessions | None = None
    # Generation requests in flight per tenant (at most config.max_requests_per_tenant).
    in_flight: dict[str, int] = field(default_factory=dict)
    # Every served model by name, the default one first; other names clients may use for them.
    models: dict[str, ModelSlot] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    # How `model: "auto"` chooses between two of them (None: no `auto`).
    route: ModelRoutePolicy | None = None
    # CPU roles: prompt rendering/tokenization on its own pool; each engine thread metered (and maybe pinned).
    roles: CpuRoles = field(default_factory=CpuRoles)
    tokenize_pool: RolePool = field(default_factory=lambda: RolePool(TOKENIZE, 2))

    @property
    def implicit_completions(self) -> bool:
        return self.config.implicit_sessions == "all"

    @property
    def default(self) -> ModelSlot:
        return next(iter(self.models.values()))


def create_app(engine: LLMEngine | dict[str, LLMEngine], *, model_name: str | None = None, auth: Auth | None = None,
               tracer: Tracer | None = None, route: ModelRoutePolicy | None = None,
               tokenize_cpus: frozenset[int] | None = None, engine_cpus: frozenset[int] | None = None,
               response_store: ResponseStore | None = None, aliases: dict[str, str] | None = None,
               config: ServerConfig | None = None, **settings: Any) -> FastAPI:
    """The app over one engine, or over several (`{served name: engine}`, the first is the default).

    With several, `route` (default: `default_route`) serves `model: "auto"`. `config` holds the server's
    settings (config.ServerConfig); `settings` override single fields of it (e.g. `max_queued_requests=8`).
    CPU roles: chat rendering and tokenization run on `config.tokenize_threads` threads (pinned to
    `tokenize_cpus`), each engine's loop on its own thread (pinned to `engine_cpus`); /metrics reports each
    role's busy time. `response_store` keeps Responses API responses (default: `config.response_store`);
    `aliases` maps other names clients use (`--served-model-name`) to served model names.
    """
    if "implicit_sessions" in settings and isinstance(settings["implicit_sessions"], bool):
        settings["implicit_sessions"] = "chat" if settings["implicit_sessions"] else "off"
    config = replace(config or ServerConfig(), **settings)
    engines = dict(engine) if isinstance(engine, dict) else {model_name or engine.model_dir.name: engine}
    if not engines:
        raise ValueError("create_app needs at least one engine")
    if AUTO_MODEL in engines or "default" in engines:
        raise ValueError(f"'{AUTO_MODEL}' and 'default' are reserved model names")
    if route is None and len(engines) > 1:
        route = default_route(engines)
    if route is not None and not {route.large, route.small} <= set(engines):
        raise ValueError(f"route models {route.large!r}/{route.small!r} are not all served")
    for e in engines.values():
        # The structured-output compiler is loaded now, not on the first request that asks for a grammar:
        # importing it holds the interpreter for about a second, a stall in every stream then in flight.
        e.runner.grammar_compiler  # noqa: B018
        e.tokenizer.max_token_chars  # noqa: B018 - the prompt size bound's vocabulary scan, likewise
    name = next(iter(engines))
    metrics = Metrics(name)
    roles = CpuRoles()

    def on_step(n: str, meter: RoleMeter) -> Callable[[LLMEngine, float, float], None]:
        def sample(eng: LLMEngine, dt: float, cpu_s: float) -> None:
            meter.record(dt, cpu_s)
            metrics.observe_step(dt, n)
        return sample

    slots = {
        n: ModelSlot(n, e, AsyncEngine(e, max_queued_requests=config.max_queued_requests, cpus=engine_cpus,
                                       on_step=on_step(n, roles.add(RoleMeter(
                                           ENGINE if len(engines) == 1 else f"{ENGINE}:{n}", 1))),
                                       on_gauges=lambda eng, n=n: metrics.sample_gauges(eng, n)),
                     ImplicitSessions(e.runner.block_size, config.max_implicit_sessions)
                     if config.implicit_sessions != "off" else None)
        for n, e in engines.items()}
    tokenize_pool = RolePool(TOKENIZE, config.tokenize_threads, tokenize_cpus)
    roles.add(tokenize_pool.meter)
    first = slots[name]
    engine = first.engine
    bridge = first.bridge
    state = ServerState(engine, bridge, auth or Auth(), metrics, tracer or Tracer(None), name, int(time.time()),
                        config, first.implicit, models=slots, aliases=dict(aliases or {}), route=route, roles=roles,
                        tokenize_pool=tokenize_pool)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        for slot in slots.values():
            slot.bridge.start()
        yield
        for slot in slots.values():
            await slot.bridge.shutdown()
        tokenize_pool.shutdown(wait=False)
        state.tracer.shutdown()

    app = FastAPI(title="sessionserve", version="0.1.0", lifespan=lifespan)
    app.state.ss = state
    # Paths outside /v1/ that need a key when config.metrics_auth is "key" (the API description too).
    keyed_paths = {"/metrics", app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url}
    keyed_paths = keyed_paths - {None} if config.metrics_auth == "key" else set()

    app.add_middleware(RequestContext, state=state, keyed_paths=frozenset(keyed_paths))

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc, state, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(format_validation_errors(exc.errors()), state, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(OpenAIError(exc.status_code, str(exc.detail), kind), state, request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request %s failed", getattr(request.state, "request_id", "?"))
        return error_response(OpenAIError(500, "Internal server error.", "server_error"), state, request.url.path)

    @app.get("/")
    @app.head("/", include_in_schema=False)  # one operation id in /openapi.json, not two alike
    async def root() -> Response:
        # Claude Code checks the base URL with HEAD / before its first request.
        return JSONResponse({"name": "sessionserve", "models": list(slots)})

    @app.get("/health")
    async def health() -> Response:
        if not all(slot.bridge.is_alive for slot in slots.values()):
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        metrics.sample_roles(roles)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [{**model_card(slot.name, state.created), "max_model_len": slot.engine.max_model_len}
                for slot in slots.values()]
        if route is not None:
            data.append({**model_card(AUTO_MODEL, state.created),
                         "max_model_len": min(slots[route.large].engine.max_model_len,
                                              slots[route.small].engine.max_model_len),
                         "routes": {"plan": route.large, "execute": route.small}})
        return {"object": "list", "data": data}

    from sessionserve.server.api import chat_completions, completions, messages, responses
    from sessionserve.server.response_store import make_response_store
    from sessionserve.server.routes_sessions import register as register_sessions
    from sessionserve.server.turn.pipeline import TurnPipeline

    pipeline = TurnPipeline(state)
    app.state.pipeline = pipeline
    for api in (chat_completions, completions):
        api.register(app, pipeline)
    responses.register(app, pipeline, response_store or make_response_store(config.response_store,
                                                                             config.response_ttl_s))
    messages.register(app, pipeline, state)
    register_sessions(app, state)
    return app


def default_route(engines: dict[str, LLMEngine]) -> ModelRoutePolicy:
    """Plan on the model with the most parameters, execute on the one with the fewest."""
    def size(name: str) -> int:
        return sum(p.numel() for p in engines[name].runner.model.parameters())

    ranked = sorted(engines, key=size)
    return ModelRoutePolicy(large=ranked[-1], small=ranked[0])


class RequestContext:
    """Each HTTP request's id, tenant (its API key, for /v1/ and keyed paths: else a 401) and early size check
    (Content-Length over the limit: 413), and the headers every answer carries: X-Request-ID, and the session
    the turn ran in. Plain ASGI, not an `@app.middleware("http")` function: that one passes every streamed
    chunk through a queue and a task of its own, event-loop time in every token of every stream."""

    def __init__(self, app: Callable, state: ServerState, keyed_paths: frozenset[str]) -> None:
        self.app = app
        self.state = state
        self.keyed_paths = keyed_paths

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state, config = self.state, self.state.config
        request = Request(scope)
        rid = request.headers.get("x-request-id") or ""
        # Ours unless the client's is short and plain (it ends up in logs and engine ids).
        request_id = rid if 0 < len(rid) <= 64 and rid.replace("-", "").isalnum() else uuid.uuid4().hex
        request.state.request_id = request_id
        request_id_var.set(request_id)
        notice = SessionIdNotice()
        session_id_notice.set(notice)  # filled by turn/identity.py as the route works out the session

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode()))
                if notice.session_id is not None and all(k != b"x-session-id" for k, _ in headers):
                    headers.append((b"x-session-id", notice.session_id.encode("latin-1", "replace")))
                if notice.warning is not None:
                    headers.append((b"x-sessionserve-warning", notice.warning.encode("latin-1", "replace")))
                message = {**message, "headers": headers}
            await send(message)

        path = request.url.path
        is_api = path.startswith("/v1/")
        error = None
        if is_api or path in self.keyed_paths:
            # OpenAI clients send `Authorization: Bearer`, Anthropic's `x-api-key`.
            key = request.headers.get("x-api-key")
            tenant = state.auth.tenant_for(request.headers.get("authorization") or (key and f"Bearer {key}"))
            if tenant is None:
                error = OpenAIError(401, "Invalid or missing API key.", "authentication_error", code="invalid_api_key")
            else:
                request.state.tenant = tenant
                request.state.engine_request_id = f"{tenant_tag(tenant)}-{request_id}"
        if is_api and error is None:
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > config.max_request_bytes:
                error = OpenAIError(413, f"Request body over {config.max_request_bytes} bytes.",
                                    "invalid_request_error", code="request_too_large")
        if error is not None:
            await error_response(error, state, path)(scope, receive, send_with_headers)
            return
        await self.app(scope, receive, send_with_headers)


def error_response(exc: OpenAIError, state: ServerState, path: str = "") -> JSONResponse:
    """The error in the protocol of the path's API: Anthropic's JSON under /v1/messages, OpenAI's elsewhere."""
    state.metrics.errors.labels(str(exc.status_code)).inc()
    headers = {"retry-after": str(math.ceil(exc.retry_after_s or 1))} if exc.status_code == 429 else None
    if path.startswith("/v1/messages"):
        from sessionserve.server.api.messages import error_body

        return JSONResponse(error_body(exc), status_code=exc.status_code, headers=headers)
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=headers)


async def read_body(request: Request) -> bytes:
    """The request body, read as it streams in: a 413 as soon as it passes the server's limit, whether or not
    the client declared a length (a chunked upload is never held in memory past the limit)."""
    if hasattr(request, "_body"):  # already read
        return request._body
    limit = request.app.state.ss.config.max_request_bytes
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise OpenAIError(413, f"Request body over {limit} bytes.", "invalid_request_error",
                                  code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # hung up half-way through its body: nobody to answer, nothing to log
        raise OpenAIError(499, "Client closed the request.", "invalid_request_error") from None
    request._body = b"".join(chunks)
    return request._body


async def read_json(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 (a 413 when it is over the size limit, a 400 when it nests
    deeper than `config.max_json_depth`)."""
    raw = await read_body(request)
    max_depth = request.app.state.ss.config.max_json_depth
    # A body of megabytes takes a second to decode and measure: off the event loop.
    body, depth = _decode_json(raw, max_depth) if len(raw) < 1 << 16 else \
        await asyncio.to_thread(_decode_json, raw, max_depth)
    if depth > max_depth:
        raise OpenAIError(400, f"Request body is nested deeper than {max_depth} levels.", "invalid_request_error",
                          code="invalid_json")
    if not isinstance(body, dict):
        raise OpenAIError(400, "Request body must be a JSON object.", "invalid_request_error")
    return body


def _decode_json(raw: bytes, max_depth: int) -> tuple[Any, int]:
    """The decoded body and how deep it nests, or a number of levels no larger than `max_depth` when it does
    not nest past it (a 400 when it is not JSON)."""
    try:
        body = json.loads(raw) if raw else None
    except RecursionError:  # nested past Python's own limit (about 1,000 levels)
        return None, max(max_depth, 1000) + 1
    except ValueError as exc:  # not JSON, not UTF-8, or a number too long to convert (over 4,300 digits)
        raise OpenAIError(400, f"Request body is not valid JSON: {exc}", "invalid_request_error",
                          code="invalid_json") from None
    # A text with no more brackets than the limit cannot nest past it: a long prompt or a list of token ids
    # skips the scan (counting bytes is ~100x faster than the scan, which holds the interpreter ~50 ms for
    # 4 MiB, a gap in every stream then in flight).
    brackets = raw.count(b"[") + raw.count(b"{")
    return body, (brackets if brackets <= max_depth else json_text_depth(raw))


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_OPEN_CLOSE = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as int8
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))


def json_text_depth(raw: bytes) -> int:
    """How deep a valid JSON text nests arrays and objects (`1`: 0, `{}`: 1): its brackets outside strings,
    summed in C (milliseconds for 4 MiB, where walking the decoded value took half a second). Valid JSON
    only: there every string ends, so one left-to-right pass finds them all."""
    steps = np.frombuffer(_JSON_STRING.sub(b"", raw).translate(_OPEN_CLOSE, _NOT_BRACKETS), dtype=np.int8)
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def tenant_tag(tenant: str) -> str:
    """A short fixed tag of a tenant for engine request ids (not its cache salt; no key ever goes in ids)."""
    return hashlib.sha256(b"request-ids:" + tenant.encode()).hexdigest()[:12]


def engine_error(exc: Exception) -> OpenAIError:
    """Map bridge/engine exceptions to OpenAI errors."""
    if isinstance(exc, EngineOverloaded):
        return OpenAIError(429, "The server is busy; retry shortly.", "rate_limit_error", code="overloaded")
    if isinstance(exc, AdmissionFull):
        return OpenAIError(429, str(exc), "rate_limit_error", code="admission_full", retry_after_s=exc.retry_after_s)
    if isinstance(exc, EngineDead):
        return OpenAIError(503, str(exc), "server_error", code="unavailable")
    if isinstance(exc, PermissionError):
        return OpenAIError(404, "Session not found.", "not_found_error", param="session_id")
    if isinstance(exc, SessionBusyError):
        return OpenAIError(409, str(exc), "invalid_request_error", param="session_id", code="session_busy")
    if isinstance(exc, ValueError):
        return OpenAIError(400, str(exc), "invalid_request_error")
    return OpenAIError(500, "Internal server error.", "server_error")
