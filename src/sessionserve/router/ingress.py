"""The ingress: Serve's HTTP entry. Works out each request's `RouteKey`, sends it to an engine replica, retries.

For a chat or completion request it renders the prompt with the model's chat
template and tokenizer (the same bytes a replica will compute), hashes its
full KV blocks with the tenant's salt, and reads the session's record from the
store (owner replica, whether it was released). The engine deployment's
`SessionKVRouter` picks the replica from that.

If the chosen replica dies before the reply is complete, the request is sent
again: Serve has dropped the dead replica, the router sees the session's owner
gone (a failover), and another replica continues it. The turn was not
committed, so it runs once; had it been committed, the store replays its
response. A streamed reply that had begun continues where it stopped: the
rerun's stream is cut to what the client has not seen yet (router/resume.py),
provided it starts with what was delivered (greedy decoding or a seed).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sessionserve.cache.block_hash import extend_block_hashes
from sessionserve.router.policy import RouteKey
from sessionserve.router.replica import TURN_PATHS, RoutedRequest
from sessionserve.router.resume import StreamDiverged, StreamLedger

logger = logging.getLogger(__name__)


class RetryableReplicaError(Exception):
    """The replica went away while serving; the request may go elsewhere."""


def _is_replica_loss(exc: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError, RetryableReplicaError))


class Ingress:
    """The Ray Serve ingress deployment class (wrapped in `ray_app`); `engine` is the engine deployment's handle."""

    def __init__(self, engine: Any, options: Any) -> None:
        from sessionserve.config import Config
        from sessionserve.llm import resolve_model_path
        from sessionserve.model.tokenizer import Tokenizer
        from sessionserve.router.store import make_store
        from sessionserve.server import Auth, make_response_store

        self.engine = engine
        self.options = options
        self.auth = Auth(dict(options.api_keys) or None)
        self.tokenizer = Tokenizer(resolve_model_path(options.model))
        self.block_size = Config.from_kwargs(**options.engine_kwargs).cache.block_size
        self.store = make_store(options.store_url)
        self.responses = make_response_store(options.store_url)
        self.max_attempts = options.max_attempts
        self.num_streams_resumed = 0  # streams continued on another replica after theirs died mid-stream

    # -- routing key ---------------------------------------------------------------------------

    def route_of(self, method: str, path: str, headers: dict[str, str], body: bytes) -> RoutedRequest:
        from sessionserve.server import route_hint, session_key, tenant_salt, valid_session_id

        key = headers.get("x-api-key")
        tenant = self.auth.tenant_for(headers.get("authorization") or (key and f"Bearer {key}")) or "default"
        raw_headers = tuple((k.encode(), v.encode()) for k, v in headers.items())
        base = RoutedRequest(method, path, b"", raw_headers, body, tenant=tenant)
        data: dict[str, Any] = {}
        if body:
            try:
                parsed = json.loads(body)
                data = parsed if isinstance(parsed, dict) else {}
            except (ValueError, RecursionError):  # not JSON, too long a number, nested too deeply
                return base  # the replica answers the 400
        skey = affinity = None
        hashes: list[bytes] = []
        messages: tuple[dict[str, Any], ...] = ()
        if path.startswith("/v1/sessions/"):  # /v1/sessions/{id}, /v1/sessions/{id}/fork: go where {id} is
            sid = path[len("/v1/sessions/"):].split("/", 1)[0]
            skey = affinity = session_key(tenant, sid) if valid_session_id(sid) else None
        elif path == "/v1/sessions" and isinstance(data.get("session_id"), str) and valid_session_id(data["session_id"]):
            skey = affinity = session_key(tenant, data["session_id"])
        elif method == "POST" and path in TURN_PATHS:
            try:
                hint = route_hint(path, headers, data, self.tokenizer, tenant, self.responses)
                skey, affinity, messages = hint.session_key, hint.affinity_key, hint.messages
                hashes = extend_block_hashes([], hint.prompt, self.block_size, salt=tenant_salt(tenant))
            except Exception:  # noqa: BLE001 - a bad request routes anywhere; the replica explains
                pass
        owner, released = None, False
        if affinity is not None:
            rec = self.store.get(affinity)
            if rec is not None:
                owner, released = rec.owner, rec.owner is None
        turn_hash = None
        if skey is not None and path in TURN_PATHS:
            turn_hash = hashlib.sha256(tenant.encode() + b"\0" + path.encode() + b"\0" + body).hexdigest()
        return RoutedRequest(method, path, b"", raw_headers, body,
                             RouteKey(affinity, owner, tuple(hashes), is_released=released), tenant, skey, turn_hash,
                             bool(data.get("stream")), messages)

    # -- forwarding ----------------------------------------------------------------------------

    async def send(self, req: RoutedRequest) -> Response:
        last_exc: BaseException | None = None
        for attempt in range(self.max_attempts):
            try:
                gen, head, req = await self._open(req, attempt)
                if req.is_stream:
                    return StreamingResponse(self._rest(gen, req, attempt), status_code=head["status"],
                                             headers=_headers(head["headers"]))
                body = b"".join([chunk async for chunk in gen])
                return Response(body, status_code=head["status"], headers=_headers(head["headers"]))
            except Exception as exc:
                if not _is_replica_loss(exc):
                    raise
                last_exc = exc
                logger.warning("replica lost during %s %s (attempt %d): %r", req.method, req.path, attempt + 1, exc)
        return JSONResponse({"error": {"message": f"No replica could serve the request: {last_exc!r}",
                                       "type": "server_error", "code": "unavailable"}}, status_code=503)

    async def _open(self, req: RoutedRequest, attempt: int) -> tuple[Any, dict[str, Any], RoutedRequest]:
        """Send `req` to a replica (a retry waits, then re-reads the session's owner); return the reply's
        chunk generator past its head, the head, and the request as sent. Raises what the replica raised."""
        if attempt:
            await asyncio.sleep(min(2.0, 0.2 * 2 ** (attempt - 1)))
            req = self._refresh(req)
        gen = self.engine.forward.options(stream=True).remote(req)
        return gen, await gen.__anext__(), req

    def _refresh(self, req: RoutedRequest) -> RoutedRequest:
        """Re-read the session's owner before a retry (the turn may have committed meanwhile)."""
        if req.session_key is None:
            return req
        rec = self.store.get(req.session_key)
        owner = rec.owner if rec is not None else req.route.owner
        return replace(req, route=replace(req.route, owner=owner, is_released=rec is not None and rec.owner is None))

    async def _rest(self, gen: Any, req: RoutedRequest, attempt: int) -> Any:
        """The body of a streamed reply; if its replica dies mid-stream, continued from another one."""
        ledger, cont = StreamLedger(), None
        while True:
            try:
                async for chunk in gen:
                    if cont is not None:
                        chunk = cont.filter(chunk)
                    ledger.record(chunk)
                    if chunk:
                        yield chunk
                return
            except StreamDiverged as exc:
                logger.warning("stream not continued: %s", exc)
            except Exception as exc:  # noqa: BLE001 - the stream already started: continue it, or end it
                logger.warning("stream lost (attempt %d): %r", attempt + 1, exc)
                if _is_replica_loss(exc) and ledger.resumable:
                    reopened = await self._reopen(req, attempt)
                    if reopened is not None:
                        gen, req, attempt = reopened
                        cont = ledger.continuation()
                        self.num_streams_resumed += 1
                        continue
            yield b'data: {"error": {"message": "replica lost mid-stream", "type": "server_error"}}\n\n'
            return

    async def _reopen(self, req: RoutedRequest, attempt: int) -> tuple[Any, RoutedRequest, int] | None:
        """After a replica loss mid-stream: send the request again until a replica answers 200, or give up."""
        while attempt + 1 < self.max_attempts:
            attempt += 1
            try:
                gen, head, req = await self._open(req, attempt)
            except Exception as exc:  # noqa: BLE001
                if _is_replica_loss(exc):
                    continue
                return None
            return (gen, req, attempt) if head["status"] == 200 else None
        return None

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve calls this after `__init__` (`serve.ingress()` with no app): the HTTP routes."""
        return make_api(self)


def make_api(ingress: Ingress) -> FastAPI:
    api = FastAPI(title="sessionserve router")

    @api.get("/router/stats")
    async def router_stats() -> dict[str, Any]:
        """The router's counters and each replica's last routing stats."""
        from sessionserve.router.stats import router_for

        router = router_for(ingress.options.engine_deployment)
        if router is None:
            return {"router": None, "replicas": {}}
        return {"router": router.stats.to_dict(), "ingress": {"num_streams_resumed": ingress.num_streams_resumed},
                "replicas": {r.replica_id.unique_id: r.routing_stats for r in router.curr_replicas.values()}}

    @api.get("/router/metrics")
    async def router_metrics() -> Response:
        """Prometheus text: routing decisions by reason, affinity/prefix hits, failovers, migrations; per replica."""
        from sessionserve.router.stats import router_for

        router = router_for(ingress.options.engine_deployment)
        lines = []
        if router is not None:
            st = router.stats
            lines.append("# TYPE sessionserve_router_requests_total counter")
            for reason, n in sorted(st.decisions.items()):
                lines.append(f'sessionserve_router_requests_total{{reason="{reason}"}} {n}')
            for name, value in (("session_requests", st.num_session_requests), ("affinity_hits", st.num_affinity_hits),
                                ("prefix_hits", st.num_prefix_hits), ("matched_blocks", st.num_matched_blocks),
                                ("failovers", st.num_failovers), ("migrations", st.num_migrations)):
                lines += [f"# TYPE sessionserve_router_{name}_total counter",
                          f"sessionserve_router_{name}_total {value}"]
            for r in router.curr_replicas.values():
                for k, v in (r.routing_stats or {}).items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        lines.append(f'sessionserve_replica_{k}{{replica="{r.replica_id.unique_id}"}} {v}')
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @api.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def proxy(path: str, request: Request) -> Response:
        """Everything else goes to an engine replica (the OpenAI and session routes, /health, /metrics)."""
        body = await request.body()
        headers = {k.lower(): v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        headers["content-length"] = str(len(body))
        # Rendering, tokenizing and the store read run off the event loop (tokenizers release the GIL).
        req = await asyncio.to_thread(ingress.route_of, request.method, "/" + path, headers, body)
        return await ingress.send(replace(req, query=request.url.query.encode()))

    return api


def _headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    skip = {b"content-length", b"transfer-encoding"}
    return {k.decode(): v.decode() for k, v in raw if k.lower() not in skip}
