"""POST /v1/chat/completions and /v1/completions: OpenAI semantics over the engine, with sessions.

A request with a session id (header `X-Session-ID` or body `session_id`)
continues that session: only the tokens past what the session holds are
prefilled, and when the reply ends in tool calls the session parks with the
tools' names (and the client's `expected_wait_s`, if given) for the
residency policy.

`model: "auto"` (a server with two or more models) routes each chat step:
plan steps to the large model, execution steps (after successful tool
results) to the small one (`router.model_route`). A small model's answer
whose tool calls fail validation is run again on the large model (an
escalation, counted; the session stays on the large model for a few steps).
A session's context follows it from model to model: each engine keeps its own
copy of the session and prefills only what it lacks. When the small model's
step may be escalated and the request streams, its answer is checked before
the first chunk goes out, so a client never sees an answer that is replaced.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from sessionserve.core.guided import GuidedDecoding
from sessionserve.core.sampling_params import SamplingParams
from sessionserve.core.session_manager import SessionMovingError
from sessionserve.llm_engine import LLMEngine, RequestOutput
from sessionserve.router.model_route import step_view, validate_tool_calls
from sessionserve.server import protocol as P
from sessionserve.server.app import AUTO_MODEL, ModelSlot, engine_error, read_json
from sessionserve.server.auth import tenant_salt
from sessionserve.server.bridge import Turn
from sessionserve.server.chat import continue_session, render_chat
from sessionserve.server.implicit import is_implicit
from sessionserve.server.tool_parser import StreamingToolParser, parse_tool_calls

if TYPE_CHECKING:
    from sessionserve.server.app import ServerState

SESSION_HEADER = "x-session-id"
# How long a turn waits for its session's KV to finish moving between tiers before a 409.
MOVE_WAIT_S = 10.0
# Sessions whose steps since their last escalation `auto` remembers (least recently routed forgotten first).
MAX_ROUTED_SESSIONS = 10_000
ROUTE_HEADER = "x-sessionserve-route"


@dataclass(slots=True)
class SessionTarget:
    """The session a request's turn runs in: the client's id, or the implicit one found for it."""

    sid: str | None


def check_session_limit(eng: LLMEngine, tenant: str, limit: int) -> None:
    """429 if `tenant` already has `limit` sessions it opened (implicit ones do not count)."""
    if sum(1 for s in eng.sessions
           if s.tenant == tenant and not is_implicit(s.session_id.split("/", 1)[1])) >= limit:
        raise P.OpenAIError(429, "Too many open sessions for this API key.", "rate_limit_error",
                            code="too_many_sessions")


def session_key(tenant: str, session_id: str) -> str:
    """Engine-side session id: namespaced by tenant, so tenants never see each other's sessions."""
    return f"{tenant}/{session_id}"


def register(app: FastAPI, state: ServerState) -> None:
    tokenize_pool = state.tokenize_pool
    # Per routed session (tenant/id): steps since its last escalation.
    steps_since_escalation: OrderedDict[str, int] = OrderedDict()

    def model_slot(model: str) -> ModelSlot | None:
        """The served model a request names; None for `auto` (chosen per step)."""
        if model == "default":
            return state.default
        if model == AUTO_MODEL and state.route is not None:
            return None
        if model not in state.models:
            raise P.OpenAIError(404, f"The model '{model}' does not exist.", "not_found_error", param="model",
                                code="model_not_found")
        return state.models[model]

    def route_step(messages: list[dict[str, Any]], tenant: str, sid: str | None) -> tuple[ModelSlot, str]:
        """The model an `auto` chat step runs on, and why."""
        assert state.route is not None
        key = session_key(tenant, sid) if sid else None
        since = steps_since_escalation.get(key) if key else None
        name, why = state.route.choose(step_view(messages), since)
        if key is not None and since is not None:
            steps_since_escalation[key] = since + 1
            steps_since_escalation.move_to_end(key)
        return state.models[name], why

    def note_escalation(tenant: str, sid: str | None) -> None:
        if sid:
            key = session_key(tenant, sid)
            steps_since_escalation[key] = 0
            steps_since_escalation.move_to_end(key)
            while len(steps_since_escalation) > MAX_ROUTED_SESSIONS:
                steps_since_escalation.popitem(last=False)

    def make_params(req: Any, num_prompt: int, guided: GuidedDecoding | None, eng: LLMEngine) -> SamplingParams:
        room = eng.max_model_len - num_prompt
        if room < 1:
            raise P.OpenAIError(400, f"This model's maximum context length is {eng.max_model_len} tokens; the "
                                     f"prompt has {num_prompt} tokens.", "invalid_request_error", param="messages",
                                code="context_length_exceeded")
        kwargs = P.sampling_kwargs(req, default_max_tokens=room)
        if kwargs["max_tokens"] > room:
            raise P.OpenAIError(400, f"max_tokens is {kwargs['max_tokens']}, but the prompt has {num_prompt} tokens "
                                     f"and the context is {eng.max_model_len}.", "invalid_request_error",
                                param="max_tokens", code="context_length_exceeded")
        try:
            return SamplingParams(**kwargs, guided=guided)
        except ValueError as exc:
            raise P.OpenAIError(400, str(exc), "invalid_request_error") from None

    def session_of(request: Request, body_sid: str | None) -> str | None:
        sid = request.headers.get(SESSION_HEADER) or body_sid
        if sid is not None and not P.valid_session_id(sid):
            raise P.OpenAIError(400, "session_id must be 1-128 characters of [A-Za-z0-9._:-].",
                                "invalid_request_error", param="session_id")
        return sid

    async def run(request: Request, prompt: list[int], params: SamplingParams, target: SessionTarget,
                  priority: str | None, slot: ModelSlot, implicit: bool = False) -> AsyncIterator[RequestOutput]:
        """Generate for `prompt`; with `implicit` and no session id, find (or open) the conversation's session.

        `target.sid` holds the session id the turn ran in once it was added.
        """
        tenant = request.state.tenant
        check_in_flight(tenant)
        state.in_flight[tenant] = state.in_flight.get(tenant, 0) + 1
        try:
            async for out in _run(request, tenant, prompt, params, target, priority, slot, implicit):
                yield out
        finally:
            state.in_flight[tenant] -= 1
            if not state.in_flight[tenant]:
                del state.in_flight[tenant]

    async def _run(request: Request, tenant: str, prompt: list[int], params: SamplingParams, target: SessionTarget,
                   priority: str | None, slot: ModelSlot, implicit: bool) -> AsyncIterator[RequestOutput]:
        rid = f"{request.state.request_id}"
        sid = target.sid
        key = session_key(tenant, sid) if sid else None
        source: Any = prompt
        if key is not None:
            def prepare(e: LLMEngine) -> list[int]:
                if e.get_session(key) is None:
                    check_session_limit(e, tenant, state.max_sessions_per_tenant)
                new, _ = continue_session(e, key, prompt, tenant, priority or "interactive")
                return new
            source = prepare
        elif implicit and slot.implicit is not None:
            index = slot.implicit

            def prepare_implicit(e: LLMEngine) -> Turn:
                salt = tenant_salt(tenant)
                found, kind = index.find(e, tenant, prompt, salt)
                ikey = session_key(tenant, found)
                new, _ = continue_session(e, ikey, prompt, tenant, priority or "interactive")
                index.commit(e, tenant, found, kind, prompt, salt)
                target.sid = found
                state.metrics.sample_implicit(index, slot.name)
                return Turn(new, ikey)
            source = prepare_implicit
        deadline = time.monotonic() + MOVE_WAIT_S
        while True:
            try:
                async for out in slot.bridge.generate(source, params, rid, session_id=key,
                                                       salt=tenant_salt(tenant), priority=priority):
                    yield out
                return
            except SessionMovingError as exc:
                # Raised while adding the turn, before any output: wait out the copy and add it again.
                if time.monotonic() > deadline:
                    raise engine_error(exc) from exc
                await asyncio.sleep(0.01)
            except P.OpenAIError:
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI error
                raise engine_error(exc) from exc

    def check_in_flight(tenant: str) -> None:
        """429 when `tenant` already has its limit of generation requests in flight."""
        if state.in_flight.get(tenant, 0) >= state.max_requests_per_tenant:
            raise P.OpenAIError(429, f"Too many requests in flight for this API key (limit "
                                     f"{state.max_requests_per_tenant}).", "rate_limit_error",
                                code="too_many_requests")

    def request_priority(request: Request, field: str | None) -> str | None:
        """The body's `priority`, else the `X-Priority` header; None: the session's (or interactive)."""
        value = field or request.headers.get("x-priority")
        if value is not None and value not in ("interactive", "batch"):
            raise P.OpenAIError(400, "priority must be 'interactive' or 'batch'.", "invalid_request_error",
                                param="priority")
        return value

    async def park(request: Request, sid: str | None, tool_names: list[str], expected_wait_s: float | None,
                   slot: ModelSlot) -> None:
        if not sid or not tool_names:
            return
        key = session_key(request.state.tenant, sid)

        def do(e: LLMEngine) -> None:
            if e.get_session(key) is not None:
                e.park(key, tuple(tool_names), expected_wait_s)

        await slot.bridge.call(do)

    wall_offset_s = time.time() - time.monotonic()

    def record(out: RequestOutput, t0: float, request: Request, sid: str | None, slot: ModelSlot,
               endpoint: str = "chat") -> None:
        eng = slot.engine
        stats = None
        if sid is not None:
            # A read of counters the engine thread owns: at worst one step stale, which a trace tolerates.
            session = eng.get_session(session_key(request.state.tenant, sid))
            stats = session.stats if session is not None else None
        state.tracer.record_request(
            name=f"{endpoint}.completion", request_id=out.request_id, wall_offset_s=wall_offset_s,
            arrival_s=out.arrival_s, scheduled_s=out.scheduled_s, first_token_s=out.first_token_s,
            finished_s=out.finished_s or time.monotonic(),
            restore_blocked_s=out.restore_wait_s,
            attributes={"sessionserve.session_id": sid, "sessionserve.session_step": stats.num_turns if stats else None,
                        "gen_ai.usage.input_tokens": len(out.prompt_token_ids),
                        "gen_ai.usage.output_tokens": len(out.token_ids),
                        "sessionserve.cached_tokens": out.num_cached_tokens,
                        "gen_ai.response.finish_reason": out.finish_reason})
        state.metrics.record_request(
            model=slot.name, ttft_s=(out.first_token_s - out.arrival_s) if out.first_token_s else None,
            e2e_s=time.monotonic() - t0, num_prompt=len(out.prompt_token_ids), num_cached=out.num_cached_tokens,
            num_output=len(out.token_ids), finish_reason=out.finish_reason or "abort")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        req = P.parse_chat_request(await read_json(request))
        chosen = model_slot(req.model)
        sid = session_of(request, req.session_id)
        tenant = request.state.tenant
        messages = req.template_messages()
        tools = req.template_tools()
        if chosen is None:
            slot, why = route_step(messages, tenant, sid)
        else:
            slot, why = chosen, None
        guided = P.guided_decoding(req)
        use_tools = bool(tools) and req.tool_choice != "none"
        tool_names = set(req.tool_names or ())
        created, cid, t0 = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}", time.monotonic()
        check_in_flight(tenant)  # before a stream's headers go out; counted when it starts
        target = SessionTarget(sid)
        priority = request_priority(request, req.priority)

        async def start(on: ModelSlot) -> AsyncIterator[RequestOutput]:
            try:
                prompt = await asyncio.get_running_loop().run_in_executor(
                    tokenize_pool, render_chat, on.engine.tokenizer, messages, tools)
            except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
                raise P.OpenAIError(400, f"Could not render the messages: {exc}", "invalid_request_error",
                                    param="messages") from None
            params = make_params(req, len(prompt), guided, on.engine)
            return run(request, prompt, params, target, priority, on, implicit=True)

        def answer(final: RequestOutput) -> tuple[str | None, list[dict[str, Any]]]:
            return parse_tool_calls(final.text, tool_names) if use_tools else (final.text, [])

        outputs = await start(slot)
        escalated_from: ModelSlot | None = None
        if chosen is None and use_tools and slot.name == state.route.small:  # type: ignore[union-attr]
            # The small model's answer is checked before any of it goes out; a bad one runs on the large model.
            final = await _collect(request, outputs)
            problem = _answer_problem(final.text, *answer(final), tools, req.tool_choice)
            if problem is None:
                outputs = _replay(final)
            else:
                state.metrics.route_escalations.labels(problem.split(":")[0]).inc()
                note_escalation(tenant, sid)
                escalated_from, why = slot, f"escalated: {problem}"
                record(final, t0, request, target.sid, slot)
                slot = state.models[state.route.large]  # type: ignore[union-attr]
                target.sid = sid  # without an id, the large model finds the conversation in its own index
                outputs = await start(slot)
        if chosen is None:
            state.metrics.route_steps.labels(slot.name, why or "").inc()
        route_headers = {ROUTE_HEADER: f"{slot.name}; {why}"} if why else {}
        model_name = slot.name

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def sse() -> AsyncIterator[str]:
                parser = StreamingToolParser(tool_names) if use_tools else None
                called: list[str] = []
                yield _sse(P.chat_chunk(cid, created, model_name, {"role": "assistant", "content": ""}))
                try:
                    async for out in outputs:
                        events = parser.feed(out.delta_text) if parser else [{"content": out.delta_text}]
                        if out.finished and parser:
                            events += parser.finish()
                        for delta in _merge_events(events):
                            called += [tc["function"]["name"] for tc in delta.get("tool_calls", [])
                                       if tc.get("function", {}).get("name")]
                            yield _sse(P.chat_chunk(cid, created, model_name, delta))
                        if out.finished:
                            reason = "tool_calls" if called else out.finish_reason
                            yield _sse(P.chat_chunk(cid, created, model_name, {}, finish_reason=reason))
                            if include_usage:
                                yield _sse(P.chat_chunk(cid, created, model_name, None, usage=_usage(out)))
                            record(out, t0, request, target.sid, slot)
                            await park(request, target.sid, called, req.expected_wait_s, slot)
                except P.OpenAIError as exc:
                    yield _sse(exc.body())
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"x-request-id": request.state.request_id, **route_headers})

        final = await _collect(request, outputs)
        content, tool_calls = answer(final)
        reason = "tool_calls" if tool_calls else final.finish_reason
        record(final, t0, request, target.sid, slot)
        await park(request, target.sid, [tc["function"]["name"] for tc in tool_calls], req.expected_wait_s, slot)
        logprobs = _chat_logprobs(slot.engine, final) if req.logprobs else None
        body = P.chat_completion(cid, created, model_name, content, tool_calls, reason, _usage(final),
                                 logprobs=logprobs)
        if escalated_from is not None:
            body["escalated_from"] = escalated_from.name
        return JSONResponse(body, headers=route_headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        req = P.parse_completion_request(await read_json(request))
        # `auto` routes chat steps; a bare completion has no step to classify and runs on the large model.
        slot = model_slot(req.model) or state.models[state.route.large]  # type: ignore[union-attr]
        eng = slot.engine
        model_name = slot.name
        sid = session_of(request, req.session_id)
        if isinstance(req.prompt, str):  # the request model normalizes prompt to a string or token ids
            prompt = await asyncio.get_running_loop().run_in_executor(tokenize_pool, eng.tokenizer.encode, req.prompt)
        else:
            prompt = list(req.prompt)
            if any(t < 0 or t >= eng.runner.arch.vocab_size for t in prompt):
                raise P.OpenAIError(400, "prompt token ids out of range", "invalid_request_error", param="prompt")
        if not prompt:
            raise P.OpenAIError(400, "The prompt is empty.", "invalid_request_error", param="prompt")
        params = make_params(req, len(prompt), None, eng)
        ids = bool(req.return_token_ids)
        created, cid, t0 = int(time.time()), f"cmpl-{uuid.uuid4().hex}", time.monotonic()
        check_in_flight(request.state.tenant)
        target = SessionTarget(sid)
        outputs = run(request, prompt, params, target, "interactive", slot, implicit=state.implicit_completions)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def sse() -> AsyncIterator[str]:
                try:
                    async for out in outputs:
                        if out.delta_text or out.finished or (ids and out.delta_token_ids):
                            yield _sse(P.completion_chunk(cid, created, model_name, out.delta_text,
                                                          out.finish_reason if out.finished else None,
                                                          token_ids=list(out.delta_token_ids) if ids else None))
                        if out.finished:
                            if include_usage:
                                yield _sse(P.completion_chunk(cid, created, model_name, None, None,
                                                              usage=_usage(out)))
                            record(out, t0, request, target.sid, slot, "text")
                except P.OpenAIError as exc:
                    yield _sse(exc.body())
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")
        final = await _collect(request, outputs)
        record(final, t0, request, target.sid, slot, "text")
        return JSONResponse(P.completion(cid, created, model_name, final.text, final.finish_reason,
                                         _usage(final), token_ids=list(final.token_ids) if ids else None,
                                         prompt_token_ids=list(final.prompt_token_ids) if ids else None))


async def _collect(request: Request, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The final output; aborts the request if the client disconnects meanwhile (seen at its next output)."""

    async def until_disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    # NOTE: a waiting task, not `request.is_disconnected()`: that polls receive() under a cancelled
    # scope, which through the HTTP middleware's task group never sees the disconnect.
    watcher = asyncio.ensure_future(until_disconnected())
    final = None
    try:
        async for out in outputs:
            if out.finished:
                final = out
                break
            if watcher.done():
                await outputs.aclose()  # the bridge aborts the request and frees its blocks
                raise P.OpenAIError(499, "Client closed the request.", "invalid_request_error")
    finally:
        watcher.cancel()
    assert final is not None
    return final


async def _replay(final: RequestOutput) -> AsyncIterator[RequestOutput]:
    """A finished output as a stream of one: all of its text in one delta."""
    yield dataclasses.replace(final, delta_text=final.text, delta_token_ids=list(final.token_ids))


def _answer_problem(text: str, content: str | None, tool_calls: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None, tool_choice: Any) -> str | None:
    """Why an answer to a request with tools is unusable (a reason for escalation), or None."""
    if not tool_calls:
        if "<tool_call>" in text:
            return "malformed tool call"
        if tool_choice == "required" or isinstance(tool_choice, dict):
            return "no tool call"
        return None
    problem = validate_tool_calls(tool_calls, tools)
    return f"invalid tool call: {problem}" if problem else None


def _usage(out: RequestOutput) -> dict[str, Any]:
    num_prompt, num_out = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_out, "total_tokens": num_prompt + num_out,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def _chat_logprobs(eng: LLMEngine, out: RequestOutput) -> dict[str, Any]:
    entries = []
    tok = eng.tokenizer
    for token_id, row in zip(out.token_ids, out.outputs[0].logprobs or []):
        def item(tid: int, lp: float) -> dict[str, Any]:
            text = tok.decode([tid], skip_special_tokens=False)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}
        top = [item(t, lp) for t, lp in sorted(row.items(), key=lambda kv: -kv[1])]
        entries.append({**item(token_id, row.get(token_id, float("-inf"))), "top_logprobs": top})
    return {"content": entries, "refusal": None}


def _merge_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Parser events to chunk deltas, dropping empty content."""
    return [e for e in events if e.get("tool_calls") or e.get("content")]


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
