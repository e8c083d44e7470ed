"""POST /v1/chat/completions: OpenAI Chat Completions over the turn pipeline.

A request with a session id (header `X-Session-ID` or body `session_id`)
continues that session; `prompt_cache_key` groups a client's conversations;
without either, the conversation's session is found from its content. When
the reply ends in tool calls the session parks with the tools' names (and the
client's `expected_wait_s`, if given). `model: "auto"` routes each step
between a large and a small model (turn/model_choice.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from sessionserve.server import protocol as P
from sessionserve.server.api.common import request_priority, sse, token_logprobs
from sessionserve.server.app import read_json
from sessionserve.server.protocol_common import openapi_route
from sessionserve.server.turn.identity import session_hint
from sessionserve.server.turn.types import (
    StepOutput,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStart,
    TurnRequest,
    TurnResult,
)

if TYPE_CHECKING:
    from sessionserve.server.turn.pipeline import ActiveTurn, TurnPipeline

ROUTE_HEADER = "x-sessionserve-route"
NO_LIMIT = 1 << 30


def to_turn(request: Request, req: P.ChatCompletionRequest) -> TurnRequest:
    sampling = P.sampling_kwargs(req, default_max_tokens=NO_LIMIT)
    sampling.pop("max_tokens")
    logprobs = sampling.pop("logprobs")
    choice = req.tool_choice
    return TurnRequest(
        protocol="chat", model=req.model, messages=req.template_messages(), tools=req.template_tools(),
        tool_choice={"name": choice["function"]["name"]} if isinstance(choice, dict) else choice,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        response_format=P.format_guide(req.response_format), sampling=sampling, max_tokens=req.max_output_tokens,
        stream=bool(req.stream),
        session=session_hint(request.headers, body_session_id=req.session_id,
                             prompt_cache_key=getattr(req, "prompt_cache_key", None)),
        priority=request_priority(request, req.priority), expected_wait_s=req.expected_wait_s, logprobs=logprobs)


def tool_call_dict(call: ToolCall) -> dict[str, Any]:
    return {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def usage(result: TurnResult) -> dict[str, Any]:
    return P.usage_dict(result.num_prompt_tokens, result.num_output_tokens, result.num_cached_tokens)


def finish_reason(result: TurnResult) -> str:
    return "stop" if result.finish_reason == "abort" else result.finish_reason


def register(app: FastAPI, pipeline: TurnPipeline) -> None:
    @app.post("/v1/chat/completions", **openapi_route(P.ChatCompletionRequest))
    async def chat_completions(request: Request) -> Any:
        req = P.parse_chat_request(await read_json(request))
        turn = to_turn(request, req)
        active = await pipeline.start(request, turn)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        headers = {ROUTE_HEADER: f"{active.model}; {active.route}"} if active.route else {}
        if turn.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream(active, cid, created, include_usage, bool(req.logprobs)),
                                     media_type="text/event-stream", headers=headers)
        result = await active.result()
        logprobs = P.chat_logprobs(token_logprobs(active.slot.engine.tokenizer, result.output)) \
            if req.logprobs else None
        body = P.chat_completion(cid, created, result.model, result.content,
                                 [tool_call_dict(c) for c in result.tool_calls], finish_reason(result),
                                 usage(result), logprobs=logprobs)
        if active.escalated_from is not None:
            body["escalated_from"] = active.escalated_from
        return JSONResponse(body, headers=headers)


async def _stream(active: ActiveTurn, cid: str, created: int, include_usage: bool,
                  want_logprobs: bool) -> AsyncIterator[str]:
    model = active.model
    tok = active.slot.engine.tokenizer
    pending: list[P.TokenLogprob] = []  # log-probabilities of tokens whose text has not gone out yet

    def chunk(delta: dict[str, Any] | None, **kw: Any) -> str:
        lp = None
        if want_logprobs and delta is not None and pending:
            lp = P.chat_logprobs(pending)
            pending.clear()
        return sse(P.chat_chunk(cid, created, model, delta, logprobs=lp, **kw))

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for event in active.events():
            if isinstance(event, StepOutput):
                if want_logprobs and event.output.delta_token_ids:
                    pending.extend(token_logprobs(tok, event.output, len(event.output.delta_token_ids)))
            elif isinstance(event, TextDelta):
                yield chunk({"content": event.text})
            elif isinstance(event, ToolCallStart):
                yield chunk({"tool_calls": [{"index": event.index, "id": event.call_id, "type": "function",
                                             "function": {"name": event.name, "arguments": ""}}]})
            elif isinstance(event, ToolCallDelta):
                yield chunk({"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]})
            elif isinstance(event, TurnResult):
                yield chunk({}, finish_reason=finish_reason(event))
                if include_usage:
                    yield sse(P.chat_chunk(cid, created, model, None, usage=usage(event)))
    except P.OpenAIError as exc:
        yield sse(exc.body())
    yield "data: [DONE]\n\n"
