"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API (`anthropic-version: 2023-06-01`).

`system` is a string or text blocks; message content is a string or blocks:
`text`, `tool_use` (assistant), `tool_result` (user; a string or text blocks,
`is_error`), `thinking` / `redacted_thinking` (accepted, not read back).
Images and documents get a 400 (a text model). Messages with role `system`
inside `messages` (Claude Code sends one) are system turns in place. Tools
with an `input_schema` are offered; server tools (`web_search_...`,
`bash_...`, ...) are accepted and not offered. `tool_choice` auto / any /
tool / none. Fields the server does not act on (`thinking`,
`context_management`, `output_config`, `service_tier`, `container`) are
accepted. `max_tokens` is a cap: an answer stops where the context ends.

The session is Claude Code's `X-Claude-Code-Session-Id` (or the
`session_id` in `metadata.user_id`), else the conversation's content; only
the new blocks of each turn are computed. `usage.input_tokens` counts what
was computed, `cache_read_input_tokens` what the session or prefix cache
already held. Errors are Anthropic's JSON (`{"type": "error", "error": ...}`).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, field_validator

from sessionserve.server import protocol as P
from sessionserve.server.api.common import request_priority, sse
from sessionserve.server.app import read_json
from sessionserve.server.protocol_common import openapi_route
from sessionserve.server.turn.identity import session_hint
from sessionserve.server.turn.pipeline import finished_events
from sessionserve.server.turn.render import render_chat
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
    from sessionserve.server.app import ServerState
    from sessionserve.server.turn.pipeline import ActiveTurn, TurnPipeline

_SKIPPED_BLOCKS = {"thinking", "redacted_thinking", "server_tool_use", "web_search_tool_result",
                   "web_fetch_tool_result", "code_execution_tool_result", "container_upload"}
_UNSUPPORTED_BLOCKS = {"image", "document", "search_result"}

# Anthropic's error types by HTTP status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}


def error_body(exc: P.OpenAIError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(exc.status_code, "invalid_request_error" if exc.status_code < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


class MessagesRequest(P.RequestModel):
    """Body of POST /v1/messages (and, without max_tokens, of count_tokens)."""

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    stream: bool | None = None
    # Extensions, as on chat completions.
    session_id: str | None = None
    priority: str | None = None
    expected_wait_s: float | None = Field(default=None, ge=0)
    seed: int | None = None

    @field_validator("stop_sequences")
    @classmethod
    def validate_stop(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not s for s in value):
            raise ValueError("stop sequences must not be empty")
        return value


def _block_text(block: Any, where: str) -> str | None:
    if isinstance(block, str):
        return block
    if not isinstance(block, dict):
        raise P.bad_request("A content block must be an object.", where)
    kind = block.get("type")
    if not isinstance(kind, str):
        raise P.bad_request("A content block's 'type' must be a string.", f"{where}.type")
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise P.bad_request("A text block needs a string 'text'.", f"{where}.text")
        return block["text"]
    if kind in _SKIPPED_BLOCKS:
        return None
    if kind in _UNSUPPORTED_BLOCKS:
        raise P.bad_request(f"Content blocks of type '{kind}' are not supported by this server (it serves a text "
                            f"model).", f"{where}.type")
    raise P.bad_request(f"Unknown content block type {kind!r}.", f"{where}.type")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise P.bad_request("Content must be a string or a list of content blocks.", where)
    return "".join(t for i, b in enumerate(content) if (t := _block_text(b, f"{where}.{i}")) is not None)


def system_messages(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if not system:
        return []
    text = system if isinstance(system, str) else "\n".join(
        t for i, b in enumerate(system) if (t := _block_text(b, f"system.{i}")) is not None)
    return [{"role": "system", "content": text}]


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic messages as chat-shaped ones: tool_use blocks become the assistant's tool calls, tool_result
    blocks tool messages (before the user's text in the same message)."""
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages.{i}"
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ("user", "assistant", "system"):
            raise P.bad_request("Each message needs a role of 'user' or 'assistant'.", f"{where}.role")
        if "content" not in msg:
            raise P.bad_request("Each message needs 'content'.", f"{where}.content")
        content = msg["content"]
        if isinstance(content, str) or role == "system":
            out.append({"role": role, "content": _text(content, f"{where}.content")})
            continue
        if not isinstance(content, list):
            raise P.bad_request("Content must be a string or a list of content blocks.", f"{where}.content")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            bwhere = f"{where}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise P.bad_request("A tool_use block needs string 'id' and 'name'.", bwhere)
                args = block.get("input", {})
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise P.bad_request("A tool_result block needs a string 'tool_use_id'.", f"{bwhere}.tool_use_id")
                result = _text(block.get("content", ""), f"{bwhere}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
            elif kind in ("tool_use", "tool_result"):
                raise P.bad_request(f"A '{kind}' block cannot be in a {role} message.", f"{bwhere}.type")
            else:
                text = _block_text(block, bwhere)
                if text is not None:
                    texts.append(text)
        if role == "assistant":
            item: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
            if calls:
                item["tool_calls"] = calls
            out.append(item)
        elif texts:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def offered_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    out = []
    names: set[str] = set()
    for i, tool in enumerate(tools or ()):
        if "input_schema" not in tool:
            if isinstance(tool.get("type"), str):
                continue  # a server tool (web search, bash, text editor, ...): not this server's to run
            raise P.bad_request("A tool needs 'input_schema'.", f"tools.{i}.input_schema")
        name = tool.get("name")
        if not P.valid_tool_name(name):
            raise P.bad_request("A tool needs a 'name' of 1 to 64 characters from a-z, A-Z, 0-9, '_' and '-'.",
                                f"tools.{i}.name")
        if name in names:
            raise P.bad_request(f"Duplicate tool name '{name}'.", f"tools.{i}.name")
        names.add(name)
        schema = tool["input_schema"]
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise P.bad_request("input_schema must be a JSON schema of type 'object'.", f"tools.{i}.input_schema")
        fn = {"name": name, "description": tool.get("description"), "parameters": schema}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out or None


def tool_choice(choice: dict[str, Any] | None, tools: list[dict[str, Any]] | None) -> tuple[Any, bool]:
    """(turn tool_choice, parallel calls allowed)."""
    if choice is None:
        return "auto", True
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind in ("auto", "none"):
        return kind, parallel
    if kind in ("any", "tool") and not tools:
        raise P.bad_request(f"tool_choice '{kind}' needs tools.", "tool_choice")
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        name = choice.get("name")
        if name not in {t["function"]["name"] for t in tools or ()}:
            raise P.bad_request(f"tool_choice names a tool that is not in 'tools': {name!r}.", "tool_choice.name")
        return {"name": name}, parallel
    raise P.bad_request("tool_choice type must be 'auto', 'any', 'tool' or 'none'.", "tool_choice.type")


def to_turn(request: Request, req: MessagesRequest) -> TurnRequest:
    if req.max_tokens is None:
        raise P.bad_request("max_tokens: Field required", "max_tokens", "missing_required_parameter")
    tools = offered_tools(req.tools)
    choice, parallel = tool_choice(req.tool_choice, tools)
    sampling = {"temperature": 1.0 if req.temperature is None else float(req.temperature),
                "top_p": 1.0 if req.top_p is None else float(req.top_p), "top_k": req.top_k or 0,
                "seed": req.seed, "stop": tuple(req.stop_sequences or ())}
    hint = session_hint(request.headers, body_session_id=req.session_id,
                        user_id=(req.metadata or {}).get("user_id"))
    return TurnRequest(protocol="messages", model=req.model,
                       messages=system_messages(req.system) + chat_messages(req.messages), tools=tools,
                       tool_choice=choice, parallel_tool_calls=parallel, sampling=sampling, max_tokens=req.max_tokens,
                       clamp_max_tokens=True, stream=bool(req.stream), session=hint,
                       priority=request_priority(request, req.priority), expected_wait_s=req.expected_wait_s)


# -- turn → Message and events ----------------------------------------------------------------------------


def usage(result: TurnResult) -> dict[str, Any]:
    return {"input_tokens": result.num_prompt_tokens - result.num_cached_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": result.num_cached_tokens,
            "output_tokens": result.num_output_tokens}


def stop_reason(result: TurnResult) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if result.finish_reason == "tool_calls":
        return "tool_use", None
    if result.finish_reason == "length":
        return "max_tokens", None
    stop = result.output.outputs[0].stop_reason
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


class MessageBuilder:
    """Builds a Message from a turn's events; the stream's events come out of the same calls."""

    def __init__(self, model: str) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.content: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the block being streamed
        self._args: dict[int, str] = {}  # streamed arguments of open tool_use blocks, by call index
        self._calls: dict[int, int] = {}  # call index -> block index
        self._done: set[int] = set()  # block indexes of complete calls
        self.started = False
        self.result: TurnResult | None = None

    def message(self, with_usage: dict[str, Any] | None = None) -> dict[str, Any]:
        reason, seq = stop_reason(self.result) if self.result is not None else (None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [dict(b) for b in self.content], "stop_reason": reason, "stop_sequence": seq,
                "usage": with_usage or (usage(self.result) if self.result is not None else
                                        {"input_tokens": 0, "output_tokens": 0})}

    def feed(self, event: TurnEvent) -> list[str]:
        out: list[str] = []
        if isinstance(event, StepOutput) and not self.started:
            self.started = True
            o = event.output
            start = {"input_tokens": len(o.prompt_token_ids) - o.num_cached_tokens, "cache_creation_input_tokens": 0,
                     "cache_read_input_tokens": o.num_cached_tokens, "output_tokens": 1}
            msg = self.message(start)
            msg["content"] = []
            out += [sse({"type": "message_start", "message": msg}, "message_start"),
                    sse({"type": "ping"}, "ping")]
        elif isinstance(event, TextDelta):
            if self._open is None or self._open["type"] != "text":
                out += self._close()
                out += self._start({"type": "text", "text": ""})
            assert self._open is not None
            self._open["text"] += event.text
            out.append(self._delta({"type": "text_delta", "text": event.text}))
        elif isinstance(event, ToolCallStart):
            out += self._close()
            out += self._start({"type": "tool_use", "id": tool_id(event.call_id), "name": event.name, "input": {}})
            self._calls[event.index] = len(self.content) - 1
            self._args[event.index] = ""
        elif isinstance(event, ToolCallDelta):
            self._args[event.index] += event.arguments
            out.append(self._delta({"type": "input_json_delta", "partial_json": event.arguments}))
        elif isinstance(event, ToolCallEnd):
            block = self._calls[event.index]
            self.content[block]["input"] = _input(event.call.arguments)
            self._done.add(block)
            out += self._close()
        elif isinstance(event, TurnResult):
            self.result = event
            out += self._close()
            # A tool call cut by the token limit is not a call: its block goes.
            self.content = [b for i, b in enumerate(self.content) if b["type"] != "tool_use" or i in self._done]
            reason, seq = stop_reason(event)
            out += [sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                         "usage": usage(event)}, "message_delta"),
                    sse({"type": "message_stop"}, "message_stop")]
        return out

    def _start(self, block: dict[str, Any]) -> list[str]:
        self.content.append(block)
        self._open = block
        start = dict(block)
        if start["type"] == "text":
            start["text"] = ""
        return [sse({"type": "content_block_start", "index": len(self.content) - 1, "content_block": start},
                    "content_block_start")]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse({"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta},
                   "content_block_delta")

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [sse({"type": "content_block_stop", "index": len(self.content) - 1}, "content_block_stop")]


# -- routes ----------------------------------------------------------------------------------------------


def register(app: FastAPI, pipeline: TurnPipeline, state: ServerState) -> None:
    @app.post("/v1/messages", **openapi_route(MessagesRequest, anthropic=True))
    async def create_message(request: Request) -> Any:
        req = P.parse_request(MessagesRequest, await read_json(request))
        turn = to_turn(request, req)
        active = await pipeline.start(request, turn)
        builder = MessageBuilder(req.model)
        if turn.stream:
            return StreamingResponse(_stream(active, builder), media_type="text/event-stream")
        result = await active.result()
        for event in finished_events(result):
            builder.feed(event)
        return JSONResponse(builder.message())

    @app.post("/v1/messages/count_tokens", **openapi_route(MessagesRequest, anthropic=True))
    async def count_tokens(request: Request) -> Any:
        req = P.parse_request(MessagesRequest, await read_json(request))
        slot = pipeline.models.slot(req.model) or state.default
        messages = system_messages(req.system) + chat_messages(req.messages)
        tools = offered_tools(req.tools)
        try:
            ids = await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, render_chat,
                                                                   slot.engine.tokenizer, messages, tools)
        except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
            raise P.bad_request(f"Could not render the messages: {exc}", "messages") from None
        return JSONResponse({"input_tokens": len(ids)})


async def _stream(active: ActiveTurn, builder: MessageBuilder) -> AsyncIterator[str]:
    try:
        async for event in active.events():
            for chunk in builder.feed(event):
                yield chunk
    except P.OpenAIError as exc:
        yield sse(error_body(exc), "error")
