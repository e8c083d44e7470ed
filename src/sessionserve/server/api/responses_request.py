"""The Responses API request (Open Responses spec 2026-04-24) and its mapping into a turn.

Input is a string or items: messages (system / developer / user / assistant,
text content), `function_call` and `function_call_output` items (calls join
the assistant message before them, outputs become tool messages); reasoning
items are accepted and not read. Images, files, item references and
compaction items get a 400 (a text model). Function tools are offered to the
model; tool types the server does not run (`web_search`, `file_search`,
`namespace`, `custom`, `tool_search`, `local_shell`, ...) are accepted and not
offered. `text.format` json_schema / json_object constrain the answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Request
from pydantic import Field, field_validator

from sessionserve.server import protocol as P
from sessionserve.server.api.common import request_priority
from sessionserve.server.protocol_common import check_stop
from sessionserve.server.turn.identity import session_hint
from sessionserve.server.turn.types import TurnRequest
from sessionserve.types.guided import GuidedDecoding

if TYPE_CHECKING:
    from sessionserve.server.response_store import StoredResponse


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


def _part_text(part: Any, where: str) -> str | None:
    """The text of a content part; None for a refusal (nothing for the model to read); 400 otherwise."""
    if not isinstance(part, dict):
        raise P.bad_request(f"Invalid content part: expected an object with a 'type'.", where)
    kind = part.get("type")
    if not isinstance(kind, str):
        raise P.bad_request("A content part's 'type' must be a string.", f"{where}.type")
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
        if kind is not None and not isinstance(kind, str):
            raise P.bad_request("An input item's 'type' must be a string.", f"{where}.type")
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
            if isinstance(kind, str):  # a tool this server does not run (FOREIGN_TOOL_TYPES, or newer)
                continue
            raise P.bad_request("Each tool needs a 'type' (a string).", f"tools.{i}.type")
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
    if isinstance(value, dict) and isinstance(value.get("type"), str) and value["type"] in FOREIGN_TOOL_TYPES:
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
