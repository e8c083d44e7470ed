"""The OpenAI protocol layer of the HTTP server, in one namespace.

This file holds the legacy completion request (`CompletionRequest`) and the
mapping of requests to engine arguments (`sampling_kwargs`,
`guided_decoding`); it re-exports the rest: errors and validation
(protocol_common), the chat request (protocol_chat) and the response builders
(protocol_responses). Routes import this module only.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from sessionserve.server.protocol_chat import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionDef,
    JsonSchemaFormat,
    ResponseFormat,
    Tool,
    ToolCall,
    ToolCallFunction,
    parse_chat_request,
    valid_tool_name,
)
from sessionserve.server.protocol_common import (
    OpenAIError,
    RequestModel,
    SamplingRequest,
    StreamOptions,
    bad_request,
    format_validation_error,
    format_validation_errors,
    not_found,
    parse_request,
    rate_limited,
    server_error,
    unauthorized,
    valid_session_id,
)
from sessionserve.server.protocol_responses import (
    LOGPROB_FLOOR,
    TokenLogprob,
    chat_chunk,
    chat_completion,
    chat_logprobs,
    completion,
    completion_chunk,
    completion_logprobs,
    model_card,
    usage_dict,
)
from sessionserve.types.guided import GuidedDecoding

__all__ = [
    # errors and validation
    "OpenAIError", "bad_request", "not_found", "unauthorized", "rate_limited", "server_error",
    "format_validation_error", "format_validation_errors", "parse_request", "valid_session_id", "RequestModel",
    # requests
    "ChatCompletionRequest", "ChatMessage", "FunctionDef", "JsonSchemaFormat", "ResponseFormat", "StreamOptions",
    "Tool", "ToolCall", "ToolCallFunction", "CompletionRequest", "valid_tool_name", "parse_chat_request", "parse_completion_request",
    "sampling_kwargs", "guided_decoding", "format_guide",
    # responses
    "chat_completion", "chat_chunk", "completion", "completion_chunk", "usage_dict",
    "TokenLogprob", "chat_logprobs", "completion_logprobs", "LOGPROB_FLOOR", "model_card",
]

# OpenAI's default for /v1/completions; chat defaults to "until the context is full".
COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_COMPLETION_LOGPROBS = 5


def _check_prompt(value: Any) -> str | list[int]:
    """A string, a list holding one string, or token ids (also as a list holding one list)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        return _check_prompt(value[0])
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        raise ValueError("only one prompt per request is supported")
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if any(t < 0 for t in value):
            raise ValueError("token ids must be >= 0")
        return value
    if isinstance(value, list) and not value:
        raise ValueError("the prompt must not be empty")
    raise ValueError("must be a string, a list with one string, or a list of token ids")


class CompletionRequest(SamplingRequest):
    """Body of POST /v1/completions (legacy). `prompt` is normalized to a string or a list of token ids."""

    prompt: Any
    max_tokens: int | None = Field(default=COMPLETION_DEFAULT_MAX_TOKENS, ge=1)
    best_of: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None
    # vLLM's extension: the prompt's and the output's token ids in the choice (an agent harness that
    # resends the history as ids needs exactly what was generated).
    return_token_ids: bool | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def validate_prompt(cls, value: Any) -> Any:
        return _check_prompt(value)

    @field_validator("best_of")
    @classmethod
    def validate_one_choice(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("only 1 is supported")
        return value

    @field_validator("echo")
    @classmethod
    def validate_echo(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("echo is not supported by this server")
        return value

    @field_validator("suffix")
    @classmethod
    def validate_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported by this server")
        return value


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a decoded JSON body; raises OpenAIError (400) on any bad field."""
    return parse_request(CompletionRequest, body)


def sampling_kwargs(req: ChatCompletionRequest | CompletionRequest, default_max_tokens: int) -> dict[str, Any]:
    """Keyword arguments for `SamplingParams` from a validated request.

    `default_max_tokens` is used when the request sets no cap: OpenAI's "until
    the context is full", so pass the room left after the prompt. A requested
    cap larger than that room is returned as is; the caller decides whether
    that is a 400 (as OpenAI does) or a clamp.
    """
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_output_tokens
        # SamplingParams.logprobs counts top alternatives; 0 still returns the sampled token's.
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens = req.max_tokens
        logprobs = req.logprobs
    if max_tokens is None:
        max_tokens = default_max_tokens
    min_tokens = req.min_tokens or 0
    if min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens}).", "min_tokens")
    return {
        "max_tokens": max_tokens,
        "temperature": 1.0 if req.temperature is None else float(req.temperature),
        "top_p": 1.0 if req.top_p is None else float(req.top_p),
        "top_k": req.top_k or 0,
        "min_p": float(req.min_p or 0.0),
        "seed": req.seed,
        "stop": tuple(req.stop or ()),
        "stop_token_ids": tuple(req.stop_token_ids or ()),
        "ignore_eos": bool(req.ignore_eos),
        "min_tokens": min_tokens,
        "logprobs": logprobs,
        "logit_bias": dict(req.logit_bias or {}),
        "presence_penalty": float(req.presence_penalty or 0.0),
        "frequency_penalty": float(req.frequency_penalty or 0.0),
        "repetition_penalty": 1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
        "speculate": req.speculate is not False,
    }


def guided_decoding(req: ChatCompletionRequest) -> GuidedDecoding | None:
    """The output constraint a chat request asks for, if any.

    tool_choice "required" or naming a function constrains the output to
    tool calls (in the model's own call format). response_format json_object / json_schema constrains
    it to JSON, but only when the model cannot call tools: a JSON grammar
    would forbid the tool calls an agent's turn may need (OpenAI applies the
    format to the final answer only).
    """
    choice = req.tool_choice
    if req.tools and (choice == "required" or isinstance(choice, dict)):
        try:
            return GuidedDecoding.tool_calls(req.template_tools() or [], req.forced_tool_name,
                                             parallel=req.parallel_tool_calls is not False)
        except ValueError as exc:
            raise bad_request(f"Invalid tools: {exc}", "tools") from None
    tools_usable = bool(req.tools) and choice != "none"
    return None if tools_usable else format_guide(req.response_format)


def format_guide(fmt: ResponseFormat | None) -> GuidedDecoding | None:
    """The constraint of a chat `response_format` (None for text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object" or fmt.json_schema is None or fmt.json_schema.schema_ is None:
        return GuidedDecoding.json_object()
    try:
        return GuidedDecoding.json_schema(fmt.json_schema.schema_)
    except ValueError as exc:
        raise bad_request(f"Invalid JSON schema: {exc}", "response_format.json_schema.schema") from None
