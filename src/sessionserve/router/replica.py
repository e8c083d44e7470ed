"""One engine replica for Ray Serve: the whole sessionserve HTTP app, called in-process, plus the store.

`EngineReplica.forward` runs a `RoutedRequest` through the replica's own
FastAPI app (`server.app.create_app`, unchanged) as an ASGI call and yields
the response head, then its body chunks. Around a session turn it keeps the
session store current:

- before: if the store already holds this exact turn (same request fingerprint)
  with its response, the response is replayed and nothing runs again: a retry
  after a lost reply never duplicates a turn;
- after: the session's token ids, messages, owner (this replica) and KV tier
  are written with compare-and-set on the version read before the turn. If
  another replica advanced the session meanwhile, a non-streamed turn answers
  409 session_busy instead of a reply the history does not contain.

A session this replica does not hold continues from what the client sends
(the OpenAI API resends the conversation). With a KV store folder
(`kv_store_dir`, one all replicas reach) its history's KV is read from there,
since every replica writes its finished turns' blocks through; otherwise, or
for what the folder lacks, the history is prefilled again here
(`num_tokens_recomputed`). The copy a session left behind on a replica it
moved from is closed by a periodic sweep once the client deletes the session
(the store no longer holds it), instead of holding KV until the idle TTL.
Draining (`__del__`, which Serve calls on scale-down after in-flight requests
finish) writes out what is queued for the shared folder and releases this
replica's sessions in the store, so their next turns route as new.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from sessionserve.obs.cpu_roles import ENGINE
from sessionserve.router.policy import RouteKey
from sessionserve.router.store import SessionRecord, make_store
from sessionserve.server import TURN_PATHS

logger = logging.getLogger(__name__)

MAX_BUSY_RETRIES = 3  # a turn that finds its session's KV mid-move is run again this many times
STALE_SWEEP_PERIOD_S = 5.0  # how often a replica looks for its copies of sessions deleted elsewhere


def _has_output(path: str, chunk: bytes) -> bool:
    """An SSE chunk that carries generated output (not the opening events, not an error)."""
    if path == "/v1/responses":
        return b"response.output_item.added" in chunk
    if path == "/v1/messages":
        return b"content_block_start" in chunk
    return b'"choices"' in chunk and b'"role"' not in chunk and b'"error"' not in chunk


def _is_moving_busy(status: int, body: bytes) -> bool:
    """The engine refused the turn because the session's KV is being moved (it says: retry)."""
    return (status == 409 or status == 200) and b"session_busy" in body and b"being moved" in body


@dataclass(frozen=True)
class RoutedRequest:
    """An HTTP request as the ingress hands it to a replica, with what the router needs."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    route: RouteKey = field(default_factory=RouteKey)
    tenant: str = "default"
    session_key: str | None = None  # tenant-namespaced, as the engine names sessions
    turn_hash: str | None = None  # fingerprint of a session turn (tenant, path, body)
    is_stream: bool = False
    messages: tuple[dict[str, Any], ...] = ()


@dataclass
class ReplicaCounters:
    num_turns: int = 0  # session turns completed here
    num_turns_replayed: int = 0  # retried turns answered from the store
    num_sessions_adopted: int = 0  # turns of sessions another replica (or none) held before
    num_tokens_recomputed: int = 0  # history tokens those adopted sessions prefilled here again
    num_store_conflicts: int = 0  # turns that lost the compare-and-set
    num_busy_retries: int = 0  # turns run again because the session's KV was mid-move
    num_sessions_released: int = 0  # sessions handed back on drain
    num_stale_copies_closed: int = 0  # parked copies of sessions the client deleted through another replica


async def asgi_call(app: Any, req: RoutedRequest) -> AsyncIterator[dict[str, Any]]:
    """Run one HTTP request through an ASGI app in this process; yield its `http.response.*` messages."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": req.method,
             "scheme": "http", "path": req.path, "raw_path": req.path.encode(), "query_string": req.query,
             "root_path": "", "headers": list(req.headers), "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()  # the caller stopped listening: tell the app the client left
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await messages.put(message)

    task = asyncio.create_task(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (msg := await messages.get()) is not None:
            yield msg
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                break
        await task
    finally:
        gone.set()
        if not task.done():
            await asyncio.wait_for(task, timeout=30)


class EngineReplica:
    """The Ray Serve deployment class (wrapped by `serve.deployment` in `ray_app`)."""

    def __init__(self, options: Any) -> None:
        from ray import serve

        from sessionserve.config import Config, fold_cpu_host_tier
        from sessionserve.llm import resolve_model_path
        from sessionserve.llm_engine import LLMEngine
        from sessionserve.model.runner import resolve_device
        from sessionserve.server import Auth, create_app, make_response_store

        self.options = options
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        config = Config.from_env(Config.from_kwargs(**options.engine_kwargs))
        config, note = fold_cpu_host_tier(config, resolve_device(config.model.device).type)
        if note:
            logger.info("replica: %s", note)
        self.engine = LLMEngine(config, resolve_model_path(options.model))
        self.app = create_app(self.engine, model_name=options.model_name, auth=Auth(dict(options.api_keys) or None),
                              response_store=make_response_store(options.store_url))
        self.bridge = self.app.state.ss.bridge
        self.bridge.start()  # the app's lifespan does this under uvicorn; here no server runs it
        self.store = make_store(options.store_url)
        self.counters = ReplicaCounters()
        self._requests: Counter[str] = Counter()  # session key -> its requests in progress here
        self._stored: set[str] = set()  # session keys this replica has written to the store
        self._sweeper: asyncio.Task | None = None  # started by the first request (the replica's loop runs then)

    async def forward(self, req: RoutedRequest) -> AsyncIterator[Any]:
        """Yield {"status", "headers"} then body chunks (bytes)."""
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_stale_copies())
        key = req.session_key
        if key:
            self._requests[key] += 1
        try:
            async for item in self._forward(req):
                yield item
        finally:
            if key:
                self._requests[key] -= 1
                if self._requests[key] <= 0:
                    del self._requests[key]

    async def _forward(self, req: RoutedRequest) -> AsyncIterator[Any]:
        key = req.session_key if req.path in TURN_PATHS and req.method == "POST" else None
        before = self.store.get(key) if key else None
        if before is not None and not req.is_stream and req.turn_hash and \
                before.last_turn_hash == req.turn_hash and before.last_response is not None:
            self.counters.num_turns_replayed += 1
            yield {"status": 200, "headers": [(b"content-type", b"application/json"),
                                              (b"x-sessionserve-replayed", b"1")]}
            yield before.last_response.encode()
            return
        adopted = key is not None and before is not None and before.owner != self.replica_id
        seeded = False
        if adopted:
            self.counters.num_sessions_adopted += 1
            assert before is not None
            # The session's history as the other replica held it (the model's own tokens), and where its
            # conversation stands: this turn then computes only what is new, as it would have there.
            seeded = await self.app.state.pipeline.adopt(key, before.tenant, before.token_ids, before.transcript)
        status, headers, chunks = 500, [], []
        for attempt in range(MAX_BUSY_RETRIES + 1):
            if key:
                await self._wait_until_settled(key)
            status, headers, chunks, held, started = 500, [], [], [], False  # started: bytes went out
            async for msg in asgi_call(self.app, req):
                if msg["type"] == "http.response.start":
                    status, headers = msg["status"], msg.get("headers", [])
                elif msg["type"] == "http.response.body" and msg.get("body"):
                    if started:
                        yield msg["body"]
                        continue
                    (chunks if not req.is_stream else held).append(msg["body"])
                    # A stream is held until its first output (chat sends a role chunk first), so a busy
                    # error at the start of the turn can still be retried; then it flows through.
                    if req.is_stream and _has_output(req.path, msg["body"]):
                        started = True
                        yield {"status": status, "headers": headers}
                        for chunk in held:
                            yield chunk
            first = b"".join(held if req.is_stream else chunks)
            if key and attempt < MAX_BUSY_RETRIES and not started and _is_moving_busy(status, first):
                self.counters.num_busy_retries += 1
                await asyncio.sleep(0.05 * (attempt + 1))
                continue
            if req.is_stream and not started:
                yield {"status": status, "headers": headers}
                for chunk in held:
                    yield chunk
            break
        body = b"".join(chunks)
        if status == 200:
            conflict = await self._after(req, key, before, None if req.is_stream else body, adopted, seeded)
            if conflict and not req.is_stream:
                status, body = 409, json.dumps({"error": {
                    "message": "The session advanced on another replica during this turn; retry it.",
                    "type": "invalid_request_error", "param": "session_id", "code": "session_busy"}}).encode()
                headers = [(b"content-type", b"application/json")]
        if not req.is_stream:
            yield {"status": status, "headers": headers}
            yield body

    async def _wait_until_settled(self, key: str, timeout_s: float = 5.0) -> None:
        """Let a move of the session's KV (offload or restore) finish before its next turn arrives.

        NOTE: a turn whose history the client rewrote cannot cut a moving session and fails busy; a
        session that keeps coming back to its replica (affinity) is often mid-offload when it does.
        """
        def moving(eng: Any) -> bool:
            s = eng.get_session(key)
            return s is not None and s.residency.value in ("offloading", "restoring")

        deadline = asyncio.get_running_loop().time() + timeout_s
        while await self.bridge.call(moving) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    async def _after(self, req: RoutedRequest, key: str | None, before: SessionRecord | None,
                     response: bytes | None, adopted: bool = False, seeded: bool = False) -> bool:
        """Bring the store up to date after a successful request. Returns True on a CAS conflict."""
        if req.method == "DELETE" and req.session_key and req.path.startswith("/v1/sessions/"):
            self.store.delete(req.session_key)
            self._stored.discard(req.session_key)
            return False
        if req.method == "POST" and req.path == "/v1/sessions" and req.session_key:
            key, before = req.session_key, self.store.get(req.session_key)
        if key is None:
            return False

        def snapshot(eng: Any) -> tuple[tuple[int, ...], str, int] | None:
            s = eng.get_session(key)
            if s is None:
                return None
            # Tokens the turns here did not compute: the cached part of what was sent.
            return tuple(s.token_ids), s.residency.value, s.stats.num_prompt_tokens - s.stats.num_computed_prompt_tokens

        snap = await self.bridge.call(snapshot)
        if snap is None:
            return False
        if adopted and before is not None:  # the session's first turn here: what it found cached, it did not redo
            # Seeded with its history, the session sent only the new tokens: what it computed beyond them
            # (-snap[2]) was history; else it sent everything, and the history not found cached was redone.
            self.counters.num_tokens_recomputed += max(0, -snap[2] if seeded else len(before.token_ids) - snap[2])
        base = before or SessionRecord(key, req.tenant)
        transcript = self.app.state.pipeline.transcript(key)
        new = replace(base, token_ids=snap[0], messages=req.messages or base.messages, owner=self.replica_id,
                      transcript=transcript if transcript is not None else base.transcript,
                      tier=snap[1], last_turn_hash=req.turn_hash if req.path in TURN_PATHS else base.last_turn_hash,
                      last_response=response.decode() if response is not None and req.path in TURN_PATHS else None)
        if self.store.put(new) is None:
            self.counters.num_store_conflicts += 1
            logger.warning("session %s advanced elsewhere during a turn on %s", key, self.replica_id)
            return True
        self._stored.add(key)
        if req.path in TURN_PATHS:
            self.counters.num_turns += 1
        return False

    async def _sweep_stale_copies(self) -> None:
        while True:
            await asyncio.sleep(STALE_SWEEP_PERIOD_S)
            try:
                await self._close_stale_copies()
            except Exception:  # noqa: BLE001 - a store hiccup must not end the sweeps
                logger.exception("sweep for stale session copies failed")

    async def _close_stale_copies(self) -> None:
        """Close this replica's parked copies of sessions the client deleted through another replica (the store
        no longer holds a session this replica stored): they would hold device blocks and host/disk space until
        the idle TTL. A copy of a session that merely moved is kept: the residency policy weighs it like any
        parked session, and it is a cached prefix if the session comes back. A session with a request in
        progress here is left alone."""
        def held(eng: Any) -> tuple[set[str], list[str]]:
            sessions = list(eng.sessions)
            return {s.session_id for s in sessions}, [s.session_id for s in sessions if s.state.value == "parked"]

        alive, parked = await self.bridge.call(held)
        self._stored &= alive | set(self._requests)  # forget sessions this engine no longer holds (closed, expired)
        candidates = [key for key in parked if key in self._stored and key not in self._requests]
        if not candidates:
            return
        # One store read per candidate, off the event loop (a remote store answers each over the network).
        stale = await asyncio.to_thread(lambda: [key for key in candidates if self.store.get(key) is None])
        if not stale:
            return

        def close(eng: Any) -> int:
            n = 0
            for key in stale:
                s = eng.get_session(key)
                if s is not None and s.state.value == "parked" and key not in self._requests:
                    n += eng.close_session(key)
            return n

        self.counters.num_stale_copies_closed += await self.bridge.call(close)
        self._stored.difference_update(stale)

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the router weighs (free KV blocks, parked sessions) and this replica's counters."""
        def read(eng: Any) -> dict[str, Any]:
            usage = eng.kv_usage()
            parked = sum(1 for s in eng.sessions if s.state.value == "parked")
            return {"num_free_blocks": usage["device_blocks_total"] - usage["device_blocks_used"],
                    "num_total_blocks": usage["device_blocks_total"], "num_parked_sessions": parked,
                    "num_sessions": len(eng.sessions.sessions)}

        stats = await self.bridge.call(read)
        stats.update(vars(self.counters))
        engine = self.app.state.ss.roles.snapshot()[ENGINE]  # in steps with work: wall s, the engine thread's CPU s
        stats.update(engine_busy_s=engine["busy_s"], engine_cpu_s=engine["cpu_s"], process_cpu_s=time.process_time())
        if self.engine.kv_store is not None:
            stats.update({f"kv_store_{k}": v for k, v in vars(self.engine.kv_store.stats).items()})
        stats["replica_id"] = self.replica_id
        return stats

    async def stats(self) -> dict[str, Any]:
        return await self.record_routing_stats()

    async def __del__(self) -> None:
        """Drain on scale-down: Serve has let in-flight requests finish; hand the sessions back."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        try:
            if self.engine.kv_store is not None:
                await asyncio.to_thread(self.engine.kv_store.flush, 10.0)
            released = self.store.release(self.replica_id)
            self.counters.num_sessions_released += len(released)
            logger.info("replica %s released %d sessions", self.replica_id, len(released))
        finally:
            await self.bridge.shutdown(drain_timeout_s=5)
            self.store.close()
