"""OpenAI wire-protocol pieces shared by the chat and legacy completion requests.

Errors (`OpenAIError` and its JSON body), the translation of pydantic
validation errors into 400s with a dotted `param`, the base class of request
models, validators for fields both APIs share (stop, logit_bias), session
ids as clients send them and as the server uses them, and the OpenAPI
description of a route (its request body and error responses).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal, NamedTuple

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

ErrorType = Literal[
    "invalid_request_error", "not_found_error", "authentication_error", "rate_limit_error", "server_error"
]


class OpenAIError(Exception):
    """An error the HTTP layer returns as `{"error": {...}}` with `status_code`."""

    def __init__(self, status_code: int, message: str, type: ErrorType = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s  # sent as Retry-After (whole seconds) with a 429

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"OpenAIError({self.status_code}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(404, message, "not_found_error", param, code)


def unauthorized(message: str = "Invalid API key.") -> OpenAIError:
    return OpenAIError(401, message, "authentication_error", None, "invalid_api_key")


def rate_limited(message: str, code: str | None = None) -> OpenAIError:
    return OpenAIError(429, message, "rate_limit_error", None, code)


def server_error(message: str = "The server had an error while processing your request.") -> OpenAIError:
    return OpenAIError(500, message, "server_error", None, None)


# --- OpenAPI: what a route takes, how it fails -------------------------------------------------------

_OPENAI_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": ["string", "null"]}}}}}
_ANTHROPIC_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                                          "properties": {"type": {"type": "string"},
                                                                         "message": {"type": "string"}}}}}
_ERROR_STATUSES = {
    400: "Invalid request: not JSON, nested too deeply, or a bad field", 401: "Missing or invalid API key",
    404: "No such model, session or response", 409: "The session is busy or already exists",
    413: "Request body over the size limit", 429: "Too many requests or sessions; retry after `retry-after`",
    500: "Server error", 503: "The engine is stopped or shutting down",
}


def openapi_route(body: type[BaseModel] | dict[str, Any] | None = None, *, is_body_required: bool = True,
                  anthropic: bool = False) -> dict[str, Any]:
    """Keyword arguments for a FastAPI route decorator that describe the route in /openapi.json: its JSON
    request body (a request model's schema, or a schema) and its error responses (OpenAI's error JSON, or
    Anthropic's). Routes read their body as raw JSON, so FastAPI cannot see it by itself."""
    error = _ANTHROPIC_ERROR_SCHEMA if anthropic else _OPENAI_ERROR_SCHEMA
    doc: dict[str, Any] = {"responses": {
        status: {"description": what, "content": {"application/json": {"schema": error}}}
        for status, what in _ERROR_STATUSES.items()}}
    if body is not None:
        schema = _inline_refs(body.model_json_schema()) if isinstance(body, type) else body
        doc["openapi_extra"] = {"requestBody": {"required": is_body_required,
                                                "content": {"application/json": {"schema": schema}}}}
    return doc


def _inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic schema with its `$defs` written in place: OpenAPI would resolve `#/$defs/...` from the
    document's root."""
    defs = schema.get("$defs", {})

    def inline(node: Any, seen: frozenset[str]) -> Any:
        if isinstance(node, list):
            return [inline(v, seen) for v in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.removeprefix("#/$defs/")
            rest = {k: inline(v, seen) for k, v in node.items() if k != "$ref"}
            if name in seen:  # a model that contains itself: described one level deep
                return {"type": "object", **rest}
            return {**inline(defs[name], seen | {name}), **rest}
        return {k: inline(v, seen) for k, v in node.items() if k != "$defs"}

    return inline(schema, frozenset())


# Pydantic error types that mean "wrong JSON type" rather than "bad value".
_TYPE_ERRORS = {"int_type", "float_type", "string_type", "bool_type", "list_type", "dict_type",
                "model_type", "model_attributes_type", "int_from_float", "none_required"}


def format_validation_errors(errors: Sequence[Any]) -> OpenAIError:
    """A 400 for the first of pydantic-style error dicts (`loc`, `msg`, `type`, `input`).

    Also takes FastAPI's `RequestValidationError.errors()`, whose locations
    start with "body".
    """
    if not errors:
        return bad_request("Invalid request.")
    err = errors[0]
    loc = list(err.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    param = ".".join(str(part) for part in loc) or None
    kind = err.get("type", "")
    msg = str(err.get("msg", "invalid value"))
    # pydantic prefixes messages of ValueErrors raised by our validators.
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    if kind == "json_invalid":
        return bad_request(f"We could not parse the JSON body of your request: {msg}.", None, "invalid_json")
    where = f"'{param}'" if param else "the request body"
    code = "invalid_type" if kind in _TYPE_ERRORS else "invalid_value"
    return bad_request(f"Invalid value for {where}: {msg.rstrip('.')}.", param, code)


def format_validation_error(exc: pydantic.ValidationError) -> OpenAIError:
    """A 400 whose `param` is the dotted path of the first bad field (e.g. `messages.0.role`)."""
    return format_validation_errors(exc.errors(include_url=False))


class RequestModel(BaseModel):
    """Base of request models: unknown fields are kept and ignored, as OpenAI-compatible servers do.

    Strict: OpenAI does not coerce "1" to 1 or 1 to true, so neither do we
    (an int is still accepted where a number is expected).
    """

    model_config = ConfigDict(extra="allow", strict=True)


# Bounds on a request's lists, checked before validation (which runs on the event loop and takes ~12 us a
# tool definition): OpenAI allows 128 tools; agents with many MCP servers send a few hundred.
MAX_TOOLS = 512
MAX_MESSAGES = 16_384  # chat messages, Responses input items, Messages API messages


def parse_request(model: type[RequestModel], body: Any) -> Any:
    """Validate a decoded JSON body against `model`; every failure is an OpenAIError."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", None, "invalid_type")
    for name, limit in (("tools", MAX_TOOLS), ("messages", MAX_MESSAGES), ("input", MAX_MESSAGES)):
        value = body.get(name)
        if isinstance(value, list) and len(value) > limit:
            raise bad_request(f"Invalid '{name}': at most {limit} items are allowed, got {len(value)}.", name,
                              "array_above_max_length")
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        raise format_validation_error(exc) from None


# --- validators shared by both request kinds (they raise ValueError; pydantic adds the path) ---

MAX_STOP_STRINGS = 4
_SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_NOT_SESSION_ID_CHARS = re.compile(r"[^A-Za-z0-9._:-]+")
# Longest session id a client may send on a turn (one the server maps when it cannot use it as sent).
MAX_CLIENT_SESSION_ID_CHARS = 512
# Readable start of a mapped id, in characters (its hash suffix makes it unique).
_MAPPED_PREFIX_CHARS = 64


def check_stop(value: Any) -> list[str] | None:
    """OpenAI `stop`: null, a string, or a list of at most 4 strings; normalized to a list."""
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(stops)}")
    if any(s == "" for s in stops):
        raise ValueError("stop sequences must not be empty")
    return stops


def valid_session_id(session_id: str) -> bool:
    """Session ids are 1 to 128 characters from [A-Za-z0-9._:-], not `.` or `..` (they appear in URLs and logs)."""
    return (isinstance(session_id, str) and _SESSION_ID.fullmatch(session_id) is not None
            and session_id not in (".", ".."))


class ClientSessionId(NamedTuple):
    """What the server makes of a session id a client sent on a turn."""

    session_id: str | None  # the id the server uses (a valid one); None: ignored
    problem: str | None  # why it was ignored, for the client's warning header (never the id itself)


def client_session_id(raw: str) -> ClientSessionId:
    """The session a client's id names: itself when valid, else a valid id derived from it, or none.

    Clients send ids that other servers take as opaque strings (`trace_0100#0`); a turn never fails over
    one. A printable id of up to MAX_CLIENT_SESSION_ID_CHARS that is not valid maps to its readable part
    (runs of other characters as `_`) plus `-` and 16 hex digits of its SHA-256, so the same id always
    reaches the same session and a valid id, which is never mapped, meets a mapped one only by a 64-bit
    hash match. An id that cannot name a session (empty, not printable, too long) is ignored.
    """
    if valid_session_id(raw):
        return ClientSessionId(raw, None)
    if not raw.strip():
        return ClientSessionId(None, "it is empty")
    if len(raw) > MAX_CLIENT_SESSION_ID_CHARS:
        return ClientSessionId(None, f"it is over {MAX_CLIENT_SESSION_ID_CHARS} characters")
    if not raw.isprintable():
        return ClientSessionId(None, "it has control or unprintable characters")
    readable = _NOT_SESSION_ID_CHARS.sub("_", raw)[:_MAPPED_PREFIX_CHARS]
    return ClientSessionId(f"{readable}-{hashlib.sha256(raw.encode()).hexdigest()[:16]}", None)


def check_logit_bias(value: Any) -> dict[int, float] | None:
    """OpenAI `logit_bias`: token id (as a JSON object key, so a string) -> bias in [-100, 100]."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("must be an object mapping token ids to biases")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not (isinstance(key, int) or (isinstance(key, str) and key.isascii() and key.isdigit())):
            raise ValueError(f"key {key!r} is not a token id")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ValueError(f"bias for token {key} must be a number in [-100, 100]")
        out[int(key)] = float(bias)
    return out


class StreamOptions(RequestModel):
    include_usage: bool | None = None


class SamplingRequest(RequestModel):
    """Fields and checks shared by chat and legacy completion requests (OpenAI's, plus our extensions)."""

    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stop: Any = None
    n: int | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: Any = None
    user: str | None = None
    # Session extension: any string; turn/identity.py decides what session it names.
    session_id: str | None = None
    # vLLM-style sampling extensions.
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    # Speculative decoding opt-out for this request (the server drafts only when started with it).
    speculate: bool | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def validate_stop(cls, value: Any) -> Any:
        return check_stop(value)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def validate_logit_bias(cls, value: Any) -> Any:
        return check_logit_bias(value)

    @field_validator("n")
    @classmethod
    def validate_n(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)
