"""OpenAI Chat Completions request: the request model with its message, tool and format types.

Field checks raise ValueError so pydantic reports the exact path; checks that
span fields (a tool message's id, tool_choice naming a tool) run after and
raise OpenAIError with the param themselves.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from sessionserve.server.protocol_common import (
    RequestModel,
    SamplingRequest,
    bad_request,
    parse_request,
)

_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_UNSUPPORTED_PARTS = {"image_url", "input_audio", "file", "image", "audio"}

Role = Literal["system", "developer", "user", "assistant", "tool"]


def valid_tool_name(name: object) -> bool:
    """Tool and format names: 1 to 64 characters from a-z, A-Z, 0-9, '_' and '-'."""
    return isinstance(name, str) and _TOOL_NAME.fullmatch(name) is not None


def _check_name(name: str) -> str:
    if not valid_tool_name(name):
        raise ValueError("a name must be 1 to 64 characters from a-z, A-Z, 0-9, '_' and '-'")
    return name


def _check_content(value: Any) -> str | list[dict[str, str]] | None:
    """Message content: a string, null, or a list of text parts (normalized to {"type", "text"} only)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("must be a string, null, or a list of content parts")
    parts: list[dict[str, str]] = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i}: a text part needs a string 'text'")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            continue  # an assistant's earlier refusal: nothing for the model to read
        elif isinstance(kind, str) and kind in _UNSUPPORTED_PARTS:
            raise ValueError(f"part {i}: content parts of type '{kind}' are not supported by this server")
        else:
            raise ValueError(f"part {i}: expected an object with type 'text', got {part!r:.80}")
    return parts


class ToolCallFunction(RequestModel):
    name: str
    arguments: str

    @field_validator("arguments", mode="before")
    @classmethod
    def validate_arguments(cls, value: Any) -> Any:
        # OpenAI wants a JSON string; some frameworks send the object itself.
        return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else value


class ToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(RequestModel):
    role: Role
    content: Any = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def validate_content(cls, value: Any) -> Any:
        return _check_content(value)


class FunctionDef(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def validate_name(cls, name: str) -> str:
        return _check_name(name)

    @field_validator("parameters")
    @classmethod
    def validate_parameters(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None and schema.get("type", "object") != "object":
            raise ValueError("the parameters JSON schema must describe an object (\"type\": \"object\")")
        return schema


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDef


class JsonSchemaFormat(RequestModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def validate_name(cls, name: str) -> str:
        return _check_name(name)


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def validate_schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("'json_schema' is required when type is 'json_schema'")
        return self


def _check_tool_choice(value: Any) -> str | dict[str, Any] | None:
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return {"type": "function", "function": {"name": fn["name"]}}
    raise ValueError("must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}")


class ChatCompletionRequest(SamplingRequest):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    priority: Literal["interactive", "batch"] | None = None
    expected_wait_s: float | None = Field(default=None, ge=0)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def validate_tool_choice(cls, value: Any) -> Any:
        return _check_tool_choice(value)


    @model_validator(mode="after")
    def validate_cross_field(self) -> ChatCompletionRequest:
        for i, msg in enumerate(self.messages):
            if msg.tool_calls and msg.role != "assistant":
                raise bad_request("Only assistant messages can have 'tool_calls'.", f"messages.{i}.tool_calls")
            if msg.role == "tool" and not msg.tool_call_id:
                raise bad_request("A tool message needs 'tool_call_id'.", f"messages.{i}.tool_call_id",
                                  "missing_required_parameter")
            if msg.content is None and msg.role != "assistant":
                raise bad_request(f"A {msg.role} message needs 'content'.", f"messages.{i}.content",
                                  "missing_required_parameter")
        names: set[str] = set()
        for i, tool in enumerate(self.tools or ()):
            if tool.function.name in names:
                raise bad_request(f"Duplicate tool name '{tool.function.name}'.", f"tools.{i}.function.name")
            names.add(tool.function.name)
        choice = self.tool_choice
        if choice in ("required",) or isinstance(choice, dict):
            if not names:
                raise bad_request("'tool_choice' needs 'tools' to be specified.", "tool_choice")
            if isinstance(choice, dict) and choice["function"]["name"] not in names:
                raise bad_request(f"tool_choice names a tool that is not in 'tools': "
                                  f"'{choice['function']['name']}'.", "tool_choice.function.name")
        if self.top_logprobs and not self.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs' to be true.", "top_logprobs")
        return self

    @property
    def max_output_tokens(self) -> int | None:
        """The requested output cap; max_completion_tokens wins over the deprecated max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


    @property
    def tool_names(self) -> set[str] | None:
        """Names of the declared tools; None when the request declares none."""
        return {t.function.name for t in self.tools} if self.tools else None

    @property
    def forced_tool_name(self) -> str | None:
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template reads them (only declared fields; developer is a system turn)."""
        out: list[dict[str, Any]] = []
        for msg in self.messages:
            item: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role,
                                    "content": msg.content}
            if msg.tool_calls:
                item["tool_calls"] = [tc.model_dump(include={"id", "type", "function"}) for tc in msg.tool_calls]
            if msg.tool_call_id is not None:
                item["tool_call_id"] = msg.tool_call_id
            if msg.name is not None:
                item["name"] = msg.name
            out.append(item)
        return out

    def template_tools(self) -> list[dict[str, Any]] | None:
        """Tools as the chat template renders them into the system prompt; None without tools."""
        if not self.tools:
            return None
        return [{"type": "function",
                 "function": t.function.model_dump(include={"name", "description", "parameters"},
                                                   exclude_none=True)}
                for t in self.tools]


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """Validate a decoded JSON body; raises OpenAIError (400) on any bad field."""
    return parse_request(ChatCompletionRequest, body)
