"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the OpenAI Responses API (Open Responses spec 2026-04-24).

Input is a string or items: messages (system / developer / user / assistant,
text content), `function_call` and `function_call_output` items; reasoning
items are accepted and not read. Images, files, item references and
compaction items get a 400 (a text model). Function tools are offered to the
model; tool types the server does not run (`web_search`, `file_search`,
`namespace`, `custom`, `tool_search`, `local_shell`, ...) are accepted and not
offered. `text.format` json_schema / json_object constrain the answer.

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
from pydantic import Field, field_validator

from sessionserve.core.guided import GuidedDecoding
from sessionserve.server import protocol as P
from sessionserve.server.api.common import request_priority, sse, token_logprobs
from sessionserve.server.app import read_json
from sessionserve.server.response_store import ResponseStore, StoredResponse
from sessionserve.server.turn.continuation import reply_message
from sessionserve.server.turn.identity import session_hint
from sessionserve.server.turn.pipeline import finished_events
from sessionserve.server.turn.types import (
    StepOutput,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    TurnEvent,
    TurnRequest,
    TurnResult,
)

if TYPE_CHECKING:
    from sessionserve.server.turn.pipeline import ActiveTurn, TurnPipeline


# Tool types other servers run for the model (or clients run under their own names): accepted, not offered.
FOREIGN_TOOL_TYPES = {"web_search", "web_search_preview", "file_search", "computer_use_preview", "code_interpreter",
                      "image_generation", "mcp", "local_shell", "shell", "custom", "namespace", "tool_search",
                      "apply_patch"}
_UNSUPPORTED_PARTS = {"input_image", "input_file", "input_audio", "input_video"}
_TEXT_PARTS = {"input_text", "output_text", "text", "summary_text"}
_INCLUDE = {"reasoning.encrypted_content", "message.output_text.logprobs", "file_search_call.results",
            "web_search_call.results", "web_search_call.action.sources", "computer_call_output.output.image_url",
            "code_interpreter_call.outputs"}


class ResponsesRequest(P.RequestModel):
    """Body of POST /v1/responses."""

    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    max_tool_calls: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    user: str | None = None
    truncation: str | None = None
    service_tier: str | None = None
    # Extensions, as on chat completions.
    session_id: str | None = None
    priority: str | None = None
    expected_wait_s: float | None = Field(default=None, ge=0)
    seed: int | None = None
    top_k: int | None = Field(default=None, ge=0)
    stop: Any = None

    @field_validator("stop", mode="before")
    @classmethod
    def validate_stop(cls, value: Any) -> Any:
        from sessionserve.server.protocol_common import check_stop

        return check_stop(value)

    @field_validator("metadata")
    @classmethod
    def validate_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())):
            raise ValueError("at most 16 pairs, keys up to 64 and values up to 512 characters")
        return value

    @field_validator("truncation")
    @classmethod
    def validate_truncation(cls, value: str | None) -> str | None:
        if value not in (None, "auto", "disabled"):
            raise ValueError("must be 'auto' or 'disabled'")
        return value

    @field_validator("include")
    @classmethod
    def validate_include(cls, value: list[str] | None) -> list[str] | None:
        for v in value or ():
            if v not in _INCLUDE:
                raise ValueError(f"unknown value {v!r}")
        return value


# -- request → turn -------------------------------------------------------------------------------------


def _part_text(part: Any, where: str) -> str | None:
    """The text of a content part; None for a refusal (nothing for the model to read); 400 otherwise."""
    if not isinstance(part, dict):
        raise P.bad_request(f"Invalid content part: expected an object with a 'type'.", where)
    kind = part.get("type")
    if kind in _TEXT_PARTS:
        if not isinstance(part.get("text"), str):
            raise P.bad_request(f"A '{kind}' part needs a string 'text'.", f"{where}.text")
        return part["text"]
    if kind == "refusal":
        return None
    if kind in _UNSUPPORTED_PARTS:
        raise P.bad_request(f"Content parts of type '{kind}' are not supported by this server (it serves a text "
                            f"model).", f"{where}.type", "unsupported_content")
    raise P.bad_request(f"Unknown content part type {kind!r}.", f"{where}.type")


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise P.bad_request("Content must be a string or a list of content parts.", where)
    return "".join(t for i, part in enumerate(content) if (t := _part_text(part, f"{where}.{i}")) is not None)


def input_messages(items: str | list[Any] | None) -> list[dict[str, Any]]:
    """Input items as chat-shaped messages: function calls join the assistant message before them, function
    call outputs become tool messages; reasoning items are skipped."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise P.bad_request("Each input item must be an object.", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise P.bad_request(f"Invalid role {role!r}: expected user, assistant, system or developer.",
                                    f"{where}.role")
            if "content" not in item:
                raise P.bad_request("A message item needs 'content'.", f"{where}.content",
                                    "missing_required_parameter")
            text = _content(item["content"], f"{where}.content")
            if role == "assistant" and out and out[-1]["role"] == "assistant" and not out[-1].get("tool_calls"):
                out[-1]["content"] = (out[-1]["content"] or "") + text
            else:
                out.append({"role": role, "content": text})
        elif kind == "function_call":
            for field in ("call_id", "name", "arguments"):
                if not isinstance(item.get(field), str):
                    raise P.bad_request(f"A function_call item needs a string '{field}'.", f"{where}.{field}",
                                        "missing_required_parameter")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise P.bad_request("A function_call_output item needs a string 'call_id'.", f"{where}.call_id",
                                    "missing_required_parameter")
            output = item.get("output")
            if output is None:
                raise P.bad_request("A function_call_output item needs 'output'.", f"{where}.output",
                                    "missing_required_parameter")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _content(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # the model's earlier reasoning: nothing this server's models read back
        elif kind in ("item_reference", "compaction"):
            raise P.bad_request(f"Input items of type '{kind}' are not supported by this server; send the items "
                                f"themselves, or continue with previous_response_id.", f"{where}.type",
                                "unsupported_item")
        else:
            raise P.bad_request(f"Unknown input item type {kind!r}.", f"{where}.type")
    return out


def function_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The function tools of a request, chat-shaped (other tool types are not offered to the model)."""
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind != "function":
            if kind in FOREIGN_TOOL_TYPES or isinstance(kind, str):
                continue
            raise P.bad_request("Each tool needs a 'type'.", f"tools.{i}.type")
        name = tool.get("name")
        if not P.valid_tool_name(name):
            raise P.bad_request("A function tool needs a 'name' of 1 to 64 characters from a-z, A-Z, 0-9, '_' "
                                "and '-'.", f"tools.{i}.name")
        if name in names:
            raise P.bad_request(f"Duplicate tool name '{name}'.", f"tools.{i}.name")
        names.add(name)
        params = tool.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise P.bad_request("The parameters JSON schema must describe an object.", f"tools.{i}.parameters")
        fn = {"name": name, "description": tool.get("description"), "parameters": params}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def tool_choice(value: Any, tools: list[dict[str, Any]]) -> tuple[Any, list[dict[str, Any]]]:
    """(turn tool_choice, the tools it leaves offered)."""
    names = {t["function"]["name"] for t in tools}
    if value is None or value in ("auto", "none", "required"):
        if value == "required" and not tools:
            raise P.bad_request("'tool_choice' is 'required' but no function tools are offered.", "tool_choice")
        return value or "auto", tools
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        if value["name"] not in names:
            raise P.bad_request(f"tool_choice names a tool that is not in 'tools': '{value['name']}'.",
                                "tool_choice.name")
        return {"name": value["name"]}, tools
    if isinstance(value, dict) and value.get("type") == "allowed_tools" and isinstance(value.get("tools"), list):
        allowed = {t.get("name") for t in value["tools"] if isinstance(t, dict)}
        mode = value.get("mode", "auto")
        if mode not in ("auto", "required", "none"):
            raise P.bad_request("allowed_tools mode must be 'auto', 'required' or 'none'.", "tool_choice.mode")
        return mode, [t for t in tools if t["function"]["name"] in allowed]
    if isinstance(value, dict) and value.get("type") in FOREIGN_TOOL_TYPES:
        return "auto", tools  # a tool this server does not run: the model answers or calls a function
    raise P.bad_request("tool_choice must be 'none', 'auto', 'required', {\"type\": \"function\", \"name\": ...} or "
                        "{\"type\": \"allowed_tools\", ...}.", "tool_choice")


def text_format(text: dict[str, Any] | None) -> GuidedDecoding | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type", "text") == "text":
        return None
    if fmt.get("type") == "json_object":
        return GuidedDecoding.json_object()
    if fmt.get("type") != "json_schema":
        raise P.bad_request(f"Unknown text.format type {fmt.get('type')!r}.", "text.format.type")
    schema = fmt.get("schema")
    if schema is None:
        return GuidedDecoding.json_object()
    try:
        return GuidedDecoding.json_schema(schema)
    except ValueError as exc:
        raise P.bad_request(f"Invalid JSON schema: {exc}", "text.format.schema") from None


def to_turn(request: Request, req: ResponsesRequest, previous: StoredResponse | None,
            history: list[dict[str, Any]]) -> TurnRequest:
    if req.background:
        raise P.bad_request("background responses are not supported by this server.", "background")
    tools = function_tools(req.tools)
    choice, offered = tool_choice(req.tool_choice, tools)
    messages = input_messages(req.input)
    if not messages and previous is None:
        raise P.bad_request("'input' must not be empty.", "input", "missing_required_parameter")
    instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []
    logprobs = req.top_logprobs or 0 if "message.output_text.logprobs" in (req.include or ()) else None
    sampling = {
        "temperature": 1.0 if req.temperature is None else float(req.temperature),
        "top_p": 1.0 if req.top_p is None else float(req.top_p), "top_k": req.top_k or 0,
        "seed": req.seed, "stop": tuple(req.stop or ()),
        "presence_penalty": float(req.presence_penalty or 0.0), "frequency_penalty": float(req.frequency_penalty or 0.0),
    }
    hint = session_hint(request.headers, body_session_id=req.session_id, prompt_cache_key=req.prompt_cache_key,
                        previous=previous.continuation if previous is not None else None)
    return TurnRequest(
        protocol="responses", model=req.model or "default", messages=messages, tools=offered or None,
        tool_choice=choice, parallel_tool_calls=req.parallel_tool_calls is not False,
        response_format=text_format(req.text), sampling=sampling, max_tokens=req.max_output_tokens,
        clamp_max_tokens=True, stream=bool(req.stream), session=hint, history=instructions + history,
        priority=request_priority(request, req.priority), expected_wait_s=req.expected_wait_s, logprobs=logprobs)


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

    @app.post("/v1/responses")
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

    @app.post("/v1/responses/compact")
    async def compact_response(request: Request) -> Any:
        # NOTE: before the {response_id} routes, which would answer this path with a 405.
        await read_json(request)
        raise P.bad_request("Compacting a conversation is not supported by this server: continue it with "
                            "previous_response_id, or send the items themselves.", None, "unsupported_endpoint")

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Any:
        record = store.get(request.state.tenant, response_id)
        if record is None:
            raise not_found(response_id)
        return JSONResponse(record.body)

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(request: Request, response_id: str) -> Any:
        record = store.get(request.state.tenant, response_id)
        if record is None:
            raise not_found(response_id)
        data = [{"id": item.get("id") or _new_id("msg"), **item} for item in record.input_items if isinstance(item, dict)]
        return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None, "has_more": False})

    @app.delete("/v1/responses/{response_id}")
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
