"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the OpenAI Responses API (Open Responses spec 2026-04-24).

The request and its mapping into a turn are in responses_request.py; here the
Response object and its stream events are built from the turn's events, and
responses are stored and read back.

`previous_response_id` is a session, not a transcript: the stored response
names the session and the point in it, and the request's new items are
prefilled on the KV the session holds there (a fork if the session has moved
on). With `store: false` the client sends the whole history every turn (Codex
does); its session is found from the conversation (and `prompt_cache_key`),
and only the new items are computed.

Streaming sends the spec's semantic events, each with `sequence_number`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from sessionserve.server import protocol as P
from sessionserve.server.api.common import sse, token_logprobs
from sessionserve.server.api.responses_request import ResponsesRequest, to_turn
from sessionserve.server.app import read_json
from sessionserve.server.protocol_common import openapi_route
from sessionserve.server.response_store import ResponseStore, StoredResponse
from sessionserve.server.turn.continuation import reply_message
from sessionserve.server.turn.pipeline import finished_events
from sessionserve.server.turn.types import (
    StepOutput,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    TurnEvent,
    TurnResult,
)

if TYPE_CHECKING:
    from sessionserve.server.turn.pipeline import ActiveTurn, TurnPipeline


# -- turn → Response object and events -------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(result: TurnResult) -> dict[str, Any]:
    return {"input_tokens": result.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": result.num_cached_tokens},
            "output_tokens": result.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.num_prompt_tokens + result.num_output_tokens}


class ResponseBuilder:
    """Builds a Response object from a turn's events; the streaming events come out of the same calls.

    Text opens a message item (one output_text part); each tool call is a function_call item. A stream
    and a non-streamed reply are built by the same code, so they always agree.
    """

    def __init__(self, req: ResponsesRequest, model: str, want_logprobs: bool, tokenizer: Any) -> None:
        self.id = _new_id("resp")
        self.req = req
        self.model = model
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.seq = 0
        self.want_logprobs = want_logprobs
        self.tokenizer = tokenizer
        self._message: dict[str, Any] | None = None  # the open message item
        self._calls: dict[int, dict[str, Any]] = {}  # open function_call items by tool call index
        self._pending_lp: list[P.TokenLogprob] = []
        self.status = "in_progress"
        self.result: TurnResult | None = None

    # -- the Response object ---------------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        req = self.req
        fmt = (req.text or {}).get("format") or {"type": "text"}
        if fmt.get("type") == "json_schema":  # the spec echoes the format without its schema
            fmt = {"type": "json_schema", "name": fmt.get("name") or "response",
                   "description": fmt.get("description"), "schema": None, "strict": bool(fmt.get("strict"))}
        tools = [{"type": "function", "name": t["name"], "description": t.get("description"),
                  "parameters": t.get("parameters"), "strict": t.get("strict")}
                 for t in req.tools or () if t.get("type") == "function"]
        choice = req.tool_choice if req.tool_choice is not None else "auto"
        if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
            choice = {**choice, "mode": choice.get("mode", "auto")}
        result = self.result
        reasoning = req.reasoning or None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "completed_at": int(time.time()) if self.status in ("completed", "incomplete", "failed") else None,
            "status": self.status,
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            "model": self.model, "previous_response_id": req.previous_response_id,
            "instructions": req.instructions, "output": list(self.output), "error": None, "tools": tools,
            "tool_choice": choice, "truncation": req.truncation or "disabled",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": {"format": fmt, **({"verbosity": req.text["verbosity"]} if (req.text or {}).get("verbosity")
                                       else {})},
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "presence_penalty": req.presence_penalty or 0.0, "frequency_penalty": req.frequency_penalty or 0.0,
            "top_logprobs": req.top_logprobs or 0,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")} if reasoning
            else None,
            "usage": usage(result) if result is not None else None,
            "max_output_tokens": req.max_output_tokens, "max_tool_calls": req.max_tool_calls,
            "store": req.store is not False, "background": False, "service_tier": req.service_tier or "default",
            "metadata": req.metadata or {}, "safety_identifier": req.safety_identifier,
            "prompt_cache_key": req.prompt_cache_key, "user": req.user,
        }

    # -- events ------------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> str:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(obj, event=kind)

    def start(self) -> list[str]:
        return [self._event("response.created", response=self.body()),
                self._event("response.in_progress", response=self.body())]

    def feed(self, event: TurnEvent) -> list[str]:
        out: list[str] = []
        if isinstance(event, StepOutput):
            if self.want_logprobs and event.output.delta_token_ids:
                self._pending_lp += token_logprobs(self.tokenizer, event.output, len(event.output.delta_token_ids))
        elif isinstance(event, TextDelta):
            if self._message is None:
                out += self._open_message()
            lp = self._take_logprobs()
            part = self._message["content"][0]
            part["text"] += event.text
            if lp is not None:
                part["logprobs"] += lp
            out.append(self._event("response.output_text.delta", item_id=self._message["id"],
                                   output_index=self.output.index(self._message), content_index=0,
                                   delta=event.text, **({"logprobs": lp} if lp is not None else {})))
        elif isinstance(event, ToolCallStart):
            out += self._close_message("completed")
            item = {"type": "function_call", "id": _new_id("fc"), "call_id": event.call_id, "name": event.name,
                    "arguments": "", "status": "in_progress"}
            self._calls[event.index] = item
            self.output.append(item)
            out.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
        elif isinstance(event, ToolCallDelta):
            item = self._calls[event.index]
            item["arguments"] += event.arguments
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=self.output.index(item), delta=event.arguments))
        elif isinstance(event, ToolCallEnd):
            item = self._calls.pop(event.index)
            item["arguments"], item["status"] = event.call.arguments, "completed"
            index = self.output.index(item)
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   arguments=item["arguments"]))
            out.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        elif isinstance(event, TurnResult):
            self.result = event
            incomplete = event.finish_reason == "length"
            out += self._close_message("incomplete" if incomplete else "completed")
            for item in list(self._calls.values()):  # a call cut by the token limit
                item["status"] = "incomplete"
                out.append(self._event("response.output_item.done", output_index=self.output.index(item),
                                       item=dict(item)))
            self._calls.clear()
            self.status = "incomplete" if incomplete else "completed"
            out.append(self._event(f"response.{self.status}", response=self.body()))
        return out

    def fail(self, exc: P.OpenAIError) -> list[str]:
        self.status = "failed"
        body = self.body()
        body["error"] = {"code": exc.code or exc.type, "message": exc.message}
        return [self._event("error", error={"type": exc.type, "code": exc.code, "message": exc.message,
                                            "param": exc.param}),
                self._event("response.failed", response=body)]

    def _take_logprobs(self) -> list[dict[str, Any]] | None:
        if not self.want_logprobs:
            return None
        entries, self._pending_lp = self._pending_lp, []
        return P.chat_logprobs(entries)["content"]

    def _open_message(self) -> list[str]:
        part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
        if self.want_logprobs:
            part["logprobs"] = []
        item = {"type": "message", "id": _new_id("msg"), "status": "in_progress", "role": "assistant",
                "content": [part]}
        self._message = item
        self.output.append(item)
        index = len(self.output) - 1
        return [self._event("response.output_item.added", output_index=index,
                            item={**item, "content": []}),
                self._event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                            part=dict(part, text=""))]

    def _close_message(self, status: str) -> list[str]:
        item, self._message = self._message, None
        if item is None:
            return []
        item["status"] = status
        index = self.output.index(item)
        part = item["content"][0]
        done = {"item_id": item["id"], "output_index": index, "content_index": 0}
        extra = {"logprobs": part["logprobs"]} if "logprobs" in part else {}
        return [self._event("response.output_text.done", **done, text=part["text"], **extra),
                self._event("response.content_part.done", **done, part=dict(part)),
                self._event("response.output_item.done", output_index=index, item=dict(item))]


# -- routes ----------------------------------------------------------------------------------------------


def register(app: FastAPI, pipeline: TurnPipeline, store: ResponseStore) -> None:
    def not_found(response_id: str, param: str | None = None) -> P.OpenAIError:
        return P.OpenAIError(404, f"Response with id '{response_id}' not found.", "not_found_error", param=param,
                             code="previous_response_not_found" if param else None)

    @app.post("/v1/responses", **openapi_route(ResponsesRequest))
    async def create_response(request: Request) -> Any:
        req = P.parse_request(ResponsesRequest, await read_json(request))
        tenant = request.state.tenant
        previous, history = None, []
        if req.previous_response_id is not None:
            previous = store.get(tenant, req.previous_response_id)
            chain = store.conversation(previous) if previous is not None else None
            if previous is None or chain is None:
                raise not_found(req.previous_response_id, "previous_response_id")
            history = chain
        turn = to_turn(request, req, previous, history)
        active = await pipeline.start(request, turn)
        want_lp = turn.logprobs is not None
        builder = ResponseBuilder(req, active.model, want_lp, active.slot.engine.tokenizer)

        def save() -> None:
            result = builder.result
            if req.store is False or result is None:
                return
            reply = reply_message(result.content, result.tool_calls)
            store.put(StoredResponse(builder.id, tenant, builder.body(), list(req.input) if isinstance(req.input, list)
                                     else [{"type": "message", "role": "user", "content": req.input or ""}],
                                     turn.messages + [reply] if turn.messages else [reply],
                                     req.previous_response_id, result.continuation))

        if turn.stream:
            return StreamingResponse(_stream(active, builder, save), media_type="text/event-stream")
        result = await active.result()
        for event in finished_events(result):
            builder.feed(event)
        save()
        return JSONResponse(builder.body())

    @app.post("/v1/responses/compact", **openapi_route(ResponsesRequest))
    async def compact_response(request: Request) -> Any:
        # NOTE: before the {response_id} routes, which would answer this path with a 405.
        await read_json(request)
        raise P.bad_request("Compacting a conversation is not supported by this server: continue it with "
                            "previous_response_id, or send the items themselves.", None, "unsupported_endpoint")

    @app.get("/v1/responses/{response_id}", **openapi_route())
    async def get_response(request: Request, response_id: str) -> Any:
        record = store.get(request.state.tenant, response_id)
        if record is None:
            raise not_found(response_id)
        return JSONResponse(record.body)

    @app.get("/v1/responses/{response_id}/input_items", **openapi_route())
    async def input_items(request: Request, response_id: str) -> Any:
        record = store.get(request.state.tenant, response_id)
        if record is None:
            raise not_found(response_id)
        data = [{"id": item.get("id") or _new_id("msg"), **item} for item in record.input_items if isinstance(item, dict)]
        return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None, "has_more": False})

    @app.delete("/v1/responses/{response_id}", **openapi_route())
    async def delete_response(request: Request, response_id: str) -> Any:
        if not store.delete(request.state.tenant, response_id):
            raise not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def _stream(active: ActiveTurn, builder: ResponseBuilder, save: Any) -> AsyncIterator[str]:
    for chunk in builder.start():
        yield chunk
    try:
        async for event in active.events():
            for chunk in builder.feed(event):
                yield chunk
        save()
    except P.OpenAIError as exc:
        for chunk in builder.fail(exc):
            yield chunk
    yield "data: [DONE]\n\n"
