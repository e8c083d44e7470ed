"""The turn pipeline: identity → model → render → continue the session → generate → tool calls → park.

`TurnPipeline.start` runs every step up to the engine taking the request, so
whatever goes wrong until then is the request's HTTP error, before a stream
begins. The returned `ActiveTurn` yields the turn's events as the engine
produces them and ends with the `TurnResult`; adapters iterate it (streaming)
or await `result()`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request

from sessionserve.server import protocol as P
from sessionserve.server.app import engine_error
from sessionserve.server.auth import tenant_salt
from sessionserve.server.bridge import OutputStream, Turn
from sessionserve.server.implicit import is_implicit
from sessionserve.server.turn import park as park_step
from sessionserve.server.turn.continuation import (
    NeedFullPrompt,
    PromptPlan,
    Transcripts,
    continue_session,
    conversation_digests,
    extend_digest,
    held_point,
    plan_prompt,
    reply_message,
    tokens_digest,
    try_splice,
)
from sessionserve.server.turn.generate import (
    check_in_flight,
    check_prompt_size,
    compile_guided,
    guided_decoding,
    make_params,
    start_generation,
    until_disconnected,
)
from sessionserve.server.turn.identity import session_key
from sessionserve.server.turn.model_choice import ModelChooser, answer_problem
from sessionserve.server.turn.tool_calls import ToolCallStream, parse_output, tool_call_stream
from sessionserve.server.turn.types import (
    Continuation,
    SessionPoint,
    StepOutput,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    TurnEvent,
    TurnRequest,
    TurnResult,
)
from sessionserve.types.sequence import ParkHint

if TYPE_CHECKING:
    from sessionserve.llm_engine import LLMEngine, RequestOutput
    from sessionserve.server.app import ModelSlot, ServerState


def check_session_limit(eng: LLMEngine, tenant: str, limit: int) -> None:
    """429 if `tenant` already has `limit` sessions it opened (implicit ones do not count)."""
    if sum(1 for s in eng.sessions
           if s.tenant == tenant and not is_implicit(s.session_id.split("/", 1)[1])) >= limit:
        raise P.OpenAIError(429, "Too many open sessions for this API key.", "rate_limit_error",
                            code="too_many_sessions")


@dataclass
class _Target:
    """Where the turn runs: filled in the engine thread once the request is added."""

    key: str | None = None  # engine session key ("tenant/id"); None: a plain request
    explicit: bool = False  # the client named the session (it is not forked, a busy one is a 409)

    @property
    def session_id(self) -> str | None:
        return self.key.split("/", 1)[1] if self.key else None


class TurnPipeline:
    """Runs turns for every protocol adapter of one server."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.models = ModelChooser(state)
        self.transcripts = {name: Transcripts() for name in state.models}
        for name, slot in state.models.items():
            # Safe before the engine threads start (they start with the app's lifespan).
            slot.engine.sessions.on_close.append(lambda sid, t=self.transcripts[name]: t.forget(sid))

    # -- sessions that move between replicas ----------------------------------------------------

    def transcript(self, key: str) -> dict[str, Any] | None:
        """Where session `key`'s conversation stands on the default model, as plain data for a session store."""
        cont = self.transcripts[self.state.default.name].latest(key)
        if cont is None:
            return None
        return {"digest": cont.digest, "stop_text": cont.point.stop_text, "stopped": cont.point.stopped}

    async def adopt(self, key: str, tenant: str, token_ids: Sequence[int], transcript: dict[str, Any] | None) -> bool:
        """Take over a session another replica held: open it with its tokens (KV comes from a shared KV
        store, else is computed on its next turn) and where its conversation stands. False (nothing done)
        if the session is held here already."""
        slot = self.state.default
        if not token_ids:
            return False

        def seed(e: LLMEngine) -> SessionPoint | None:
            if e.get_session(key) is not None:
                return None
            e.open_session(key, tenant=tenant)
            session = e.get_session(key)
            assert session is not None
            session.token_ids = list(token_ids)
            return SessionPoint(key, len(session.token_ids), session.stats.num_turns, tokens_digest(token_ids),
                                transcript.get("stop_text") if transcript else None,
                                bool(transcript.get("stopped", True)) if transcript else True)

        point = await slot.bridge.call(seed)
        if point is not None and transcript is not None:
            self.transcripts[slot.name].record(tenant, Continuation(point, transcript["digest"]))
        return point is not None

    # -- a turn ---------------------------------------------------------------------------------

    async def start(self, request: Request, turn: TurnRequest) -> ActiveTurn:
        state = self.state
        tenant = request.state.tenant
        check_in_flight(state, tenant)  # before a stream's headers go out; counted when it runs
        hint = turn.session
        route_key = (session_key(tenant, hint.explicit) if hint.explicit
                     else hint.previous.point.key if hint.previous else
                     session_key(tenant, hint.group) if hint.group else None)
        slot, why = self.models.choose(turn, route_key)
        active = await self._start_on(request, turn, slot, why)
        if self.models.is_checked(turn, slot):
            # The small model's answer is checked before any of it goes out; a bad one runs on the large model.
            final = await active.result()
            problem = answer_problem(final.output.text, final.content, final.tool_calls, turn.tools,
                                     turn.tool_choice)
            if problem is None:
                active = ActiveTurn.replay(active, final)
            else:
                state.metrics.route_escalations.labels(problem.split(":")[0]).inc()
                large = self.models.escalate(route_key)
                active = await self._start_on(request, turn, large, f"escalated: {problem}")
                active.escalated_from = slot.name
                slot, why = large, active.route
        if state.route is not None and self.models.slot(turn.model) is None:
            state.metrics.route_steps.labels(slot.name, why or "").inc()
        return active

    async def _start_on(self, request: Request, turn: TurnRequest, slot: ModelSlot, why: str | None) -> ActiveTurn:
        tenant = request.state.tenant
        target = _Target(explicit=turn.session.explicit is not None)
        if turn.session.explicit is not None:
            target.key = session_key(tenant, turn.session.explicit)
        check_prompt_size(turn, slot.engine)
        guided = guided_decoding(turn)
        if guided is not None:
            await compile_guided(slot, guided)
        if turn.messages is None:
            prompt = await self._raw_prompt(turn, slot)
            prepare, num_prompt = self._prepare_raw(request, turn, slot, prompt, target), len(prompt)
            plan = None
        else:
            plan = await self._plan(request, turn, slot, target, want_full=False)
            prepare, num_prompt = self._prepare_chat(request, turn, slot, plan, target), plan.num_prompt_tokens
        params = make_params(turn.sampling, turn.max_tokens, num_prompt, slot.engine, turn.clamp_max_tokens,
                             guided=guided, logprobs=turn.logprobs)
        try:
            outputs = await start_generation(self.state, request, slot, prepare, params, turn.priority,
                                             self._park_hint(turn, slot))
        except NeedFullPrompt:
            assert turn.messages is not None
            plan = await self._plan(request, turn, slot, target, want_full=True)
            params = make_params(turn.sampling, turn.max_tokens, plan.num_prompt_tokens, slot.engine,
                                 turn.clamp_max_tokens, guided=guided, logprobs=turn.logprobs)
            outputs = await start_generation(self.state, request, slot,
                                             self._prepare_chat(request, turn, slot, plan, target), params,
                                             turn.priority, self._park_hint(turn, slot))
        return ActiveTurn(self, request, turn, slot, outputs, target, plan, why)

    def _park_hint(self, turn: TurnRequest, slot: ModelSlot) -> ParkHint:
        """What the session waits on once the turn ends, read in the engine thread as it ends: the client's
        expected tool time, and the tools the reply calls (parsed as the stream parses them)."""
        if not turn.uses_tools:
            return ParkHint(turn.expected_wait_s)
        tok, names = slot.engine.tokenizer, turn.tool_names

        def tool_names(ids: Sequence[int]) -> tuple[str, ...]:
            _, calls, _ = parse_output(tok.decode(list(ids)), names, tok.tool_format)
            return tuple(c.name for c in calls)

        return ParkHint(turn.expected_wait_s, tool_names)

    # -- render and continue -------------------------------------------------------------------

    async def _raw_prompt(self, turn: TurnRequest, slot: ModelSlot) -> list[int]:
        eng = slot.engine
        if isinstance(turn.prompt, str):
            try:
                prompt = await asyncio.get_running_loop().run_in_executor(self.state.tokenize_pool,
                                                                          eng.tokenizer.encode, turn.prompt)
            except (TypeError, ValueError) as exc:  # e.g. a lone surrogate: not text the tokenizer takes
                raise P.bad_request(f"The prompt is not valid text: {exc}", "prompt") from None
        else:
            prompt = list(turn.prompt or ())
            if any(t < 0 or t >= eng.runner.arch.vocab_size for t in prompt):
                raise P.OpenAIError(400, "prompt token ids out of range", "invalid_request_error", param="prompt")
        if not prompt:
            raise P.OpenAIError(400, "The prompt is empty.", "invalid_request_error", param="prompt")
        return prompt

    async def _plan(self, request: Request, turn: TurnRequest, slot: ModelSlot, target: _Target,
                    want_full: bool) -> PromptPlan:
        loop = asyncio.get_running_loop()
        pool = self.state.tokenize_pool
        conv = turn.conversation
        try:
            digests = await loop.run_in_executor(pool, conversation_digests, turn.tools, conv)
            held = None
            if not want_full:
                held = held_point(digests, conv, self.transcripts[slot.name], request.state.tenant,
                                  target.key if target.explicit else None, turn.session.previous)
            return await loop.run_in_executor(pool, plan_prompt, slot.engine.tokenizer, conv, turn.tools, held,
                                              digests, want_full)
        except P.OpenAIError:
            raise
        except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
            raise P.OpenAIError(400, f"Could not render the messages: {exc}", "invalid_request_error",
                                param="messages") from None

    def _prepare_chat(self, request: Request, turn: TurnRequest, slot: ModelSlot, plan: PromptPlan,
                      target: _Target):  # noqa: ANN202 - Callable[[LLMEngine], Turn]
        tenant = request.state.tenant
        priority = turn.priority or "interactive"
        state = self.state
        metrics = state.metrics

        def prepare(e: LLMEngine) -> Turn:
            if plan.splice is not None:
                # A client-named session runs its own turns; a conversation found by content continues in
                # place only a session that was found by content too (else it forks it).
                key = plan.splice.point.key
                in_place = key == target.key if target.explicit else (
                    turn.session.previous is not None or is_implicit(key.split("/", 1)[1]))
                found = try_splice(e, plan.splice, tenant, may_fork=not target.explicit, in_place=in_place)
                if found is not None and (not target.explicit or found[0] == target.key):
                    target.key, delta = found
                    metrics.continuations.labels(slot.name, "exact").inc()
                    if slot.implicit is not None and not target.explicit:
                        session = e.get_session(target.key)
                        assert session is not None
                        slot.implicit.commit(e, tenant, target.session_id, "hit", session.token_ids + delta,
                                             tenant_salt(tenant))
                    return Turn(delta, target.key)
                if plan.full is None:
                    raise NeedFullPrompt
            assert plan.full is not None
            prompt = plan.full
            if target.explicit:
                assert target.key is not None
                if e.get_session(target.key) is None:
                    check_session_limit(e, tenant, state.config.max_sessions_per_tenant)
                new, reused = continue_session(e, target.key, prompt, tenant, priority)
                metrics.continuations.labels(slot.name, "prefix" if reused else "new").inc()
                return Turn(new, target.key)
            index = slot.implicit
            if index is None:
                metrics.continuations.labels(slot.name, "none").inc()
                return Turn(prompt, None)
            salt = tenant_salt(tenant)
            found_id, kind = index.find(e, tenant, prompt, salt)
            target.key = session_key(tenant, found_id)
            new, reused = continue_session(e, target.key, prompt, tenant, priority)
            index.commit(e, tenant, found_id, kind, prompt, salt)
            metrics.sample_implicit(index, slot.name)
            metrics.continuations.labels(slot.name, "prefix" if reused else "new").inc()
            return Turn(new, target.key)

        return prepare

    def _prepare_raw(self, request: Request, turn: TurnRequest, slot: ModelSlot, prompt: list[int],
                     target: _Target):  # noqa: ANN202 - Callable[[LLMEngine], Turn]
        tenant = request.state.tenant
        state = self.state

        def prepare(e: LLMEngine) -> Turn:
            if target.key is not None:
                if e.get_session(target.key) is None:
                    check_session_limit(e, tenant, state.config.max_sessions_per_tenant)
                new, _ = continue_session(e, target.key, prompt, tenant, turn.priority or "interactive")
                return Turn(new, target.key)
            index = slot.implicit
            if index is None or not state.implicit_completions:
                return Turn(prompt, None)
            salt = tenant_salt(tenant)
            found_id, kind = index.find(e, tenant, prompt, salt)
            target.key = session_key(tenant, found_id)
            new, _ = continue_session(e, target.key, prompt, tenant, turn.priority or "interactive")
            index.commit(e, tenant, found_id, kind, prompt, salt)
            state.metrics.sample_implicit(index, slot.name)
            return Turn(new, target.key)

        return prepare


class ActiveTurn:
    """A turn the engine has taken: iterate `events()` once (or await `result()`)."""

    def __init__(self, pipeline: TurnPipeline, request: Request, turn: TurnRequest, slot: ModelSlot,
                 outputs: OutputStream | None, target: _Target, plan: PromptPlan | None, route: str | None,
                 replayed: TurnResult | None = None) -> None:
        self.pipeline = pipeline
        self.request = request
        self.turn = turn
        self.slot = slot
        self.outputs = outputs
        self.target = target
        self.plan = plan
        self.route = route
        self.escalated_from: str | None = None
        self.t0 = time.monotonic()
        self._replayed = replayed
        self._done = False

    @classmethod
    def replay(cls, done: ActiveTurn, result: TurnResult) -> ActiveTurn:
        """A finished turn as a turn to stream: its whole output as one step."""
        return cls(done.pipeline, done.request, done.turn, done.slot, None, done.target, done.plan, done.route,
                   replayed=result)

    @property
    def model(self) -> str:
        return self.slot.name

    def close(self) -> None:
        """Abort the request if it has not finished (the client went away)."""
        if self.outputs is not None:
            self.outputs.close()

    async def events(self) -> AsyncIterator[TurnEvent]:
        if self._replayed is not None:
            async for event in self._replay_events(self._replayed):
                yield event
            return
        assert self.outputs is not None and not self._done
        self._done = True
        turn = self.turn
        parser = tool_call_stream(self.slot.engine.tokenizer.tool_format, turn.tool_names) if turn.uses_tools else None
        text: list[str] = []
        try:
            async for out in self.outputs:
                yield StepOutput(out)
                events: list[TurnEvent] = list(parser.feed(out.delta_text)) if parser else (
                    [TextDelta(out.delta_text)] if out.delta_text else [])
                if out.finished and parser:
                    events += parser.finish()
                for event in events:
                    if isinstance(event, TextDelta):
                        text.append(event.text)
                    yield event
                if out.finished:
                    yield await self._finish(out, parser, "".join(text))
                    return
        except P.OpenAIError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed engine step: this request's error
            raise engine_error(exc) from exc
        finally:
            self.close()

    async def _replay_events(self, result: TurnResult) -> AsyncIterator[TurnEvent]:
        for event in finished_events(dataclasses.replace(result, route=self.route)):
            yield event

    async def _finish(self, out: RequestOutput, parser: ToolCallStream | None, text: str) -> TurnResult:
        calls = list(parser.calls) if parser else []
        content = parser.content if parser else text
        cut = parser is not None and parser.is_cut
        reason = out.finish_reason or "abort"
        finish = "length" if reason == "length" else "tool_calls" if calls and reason == "stop" else reason
        pipeline = self.pipeline
        state = pipeline.state
        key = self.target.key
        point = await park_step.park(self.slot, key, is_whole_reply=not cut)
        park_step.record(state, self.slot, out, self.t0, f"{self.turn.protocol}.completion",
                         self.target.session_id, point.num_turns if point else None)
        cont = None
        if point is not None and self.plan is not None:
            cont = Continuation(point, extend_digest(self.plan.digest, reply_message(content, calls)))
            pipeline.transcripts[self.slot.name].record(self.request.state.tenant, cont)
        return TurnResult(out, content, calls, finish, self.slot.name, self.target.session_id, key,
                          route=self.route, escalated_from=self.escalated_from, continuation=cont, cut_tool_call=cut)

    async def result(self) -> TurnResult:
        """The finished turn; aborts the request as soon as the client disconnects (queued or running)."""
        events = self.events()
        watcher = asyncio.ensure_future(until_disconnected(self.request))
        try:
            while True:
                step = asyncio.ensure_future(anext(events))
                await asyncio.wait((step, watcher), return_when=asyncio.FIRST_COMPLETED)
                if not step.done():  # the client hung up before the next output (maybe before any)
                    step.cancel()
                    await asyncio.gather(step, return_exceptions=True)
                    self.close()
                    raise P.OpenAIError(499, "Client closed the request.", "invalid_request_error")
                try:
                    event = step.result()
                except StopAsyncIteration:
                    break
                if isinstance(event, TurnResult):
                    return event
        finally:
            watcher.cancel()
            await events.aclose()
        raise P.OpenAIError(500, "The turn ended without a result.", "server_error")


def finished_events(result: TurnResult) -> list[TurnEvent]:
    """A finished turn as the events that would have streamed it: its whole output as one step, the text,
    then the calls, then the result."""
    out = result.output
    events: list[TurnEvent] = [StepOutput(dataclasses.replace(out, delta_text=out.text,
                                                              delta_token_ids=list(out.token_ids)))]
    if result.content:
        events.append(TextDelta(result.content))
    for i, call in enumerate(result.tool_calls):
        events += [ToolCallStart(i, call.call_id, call.name), ToolCallDelta(i, call.arguments), ToolCallEnd(i, call)]
    events.append(result)
    return events
