"""OpenAI wire-protocol pieces shared by the chat and legacy completion requests.

Errors (`OpenAIError` and its JSON body), the translation of pydantic
validation errors into 400s with a dotted `param`, the base class of request
models, and validators for fields both APIs share (stop, session_id,
logit_bias).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

ErrorType = Literal[
    "invalid_request_error", "not_found_error", "authentication_error", "rate_limit_error", "server_error"
]


class OpenAIError(Exception):
    """An error the HTTP layer returns as `{"error": {...}}` with `status_code`."""

    def __init__(self, status_code: int, message: str, type: ErrorType = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

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


def parse_request(model: type[RequestModel], body: Any) -> Any:
    """Validate a decoded JSON body against `model`; every failure is an OpenAIError."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", None, "invalid_type")
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        raise format_validation_error(exc) from None


# --- validators shared by both request kinds (they raise ValueError; pydantic adds the path) ---

MAX_STOP_STRINGS = 4
_SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


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
    """Session ids are 1 to 128 characters from [A-Za-z0-9._:-] (they appear in URLs and logs)."""
    return isinstance(session_id, str) and _SESSION_ID.fullmatch(session_id) is not None


def check_session_id(value: str | None) -> str | None:
    if value is not None and not valid_session_id(value):
        raise ValueError("must be 1 to 128 characters from [A-Za-z0-9._:-]")
    return value


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
    # Session extension.
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

    @field_validator("session_id")
    @classmethod
    def validate_session_id(cls, value: str | None) -> str | None:
        return check_session_id(value)

    @field_validator("n")
    @classmethod
    def validate_n(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)
