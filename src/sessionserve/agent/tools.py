"""The tool registry: Python functions (sync or async) as OpenAI tools, with per-tool limits.

The JSON schema of a tool's parameters comes from its type hints through a
pydantic model built from the signature, so `def f(path: str, n: int = 5)`
and a parameter typed as a pydantic model both work; the same model
validates the arguments the model sends. Each tool carries its timeout,
whether it is idempotent (safe to retry blindly), a concurrency limit, and
the tools whose calls it waits for within a step.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ToolError(Exception):
    """A tool's failure, with retry hints. Any other exception counts as retryable without a wait hint."""

    def __init__(self, message: str, *, is_retryable: bool = True, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.is_retryable = is_retryable
        self.retry_after_s = retry_after_s


class ToolArgumentsError(ToolError):
    """The model sent arguments that don't parse or don't match the schema: retrying can't fix them."""

    def __init__(self, message: str) -> None:
        super().__init__(message, is_retryable=False)


@dataclass(frozen=True)
class Tool:
    """One tool: the function, its schema and the runtime limits that apply to its calls."""

    name: str
    fn: Callable[..., Any]
    description: str
    args_model: type[BaseModel] = field(repr=False)
    timeout_s: float | None = 30.0  # per attempt; None waits forever
    is_idempotent: bool = True  # False: never retried automatically (the model sees the error)
    max_concurrency: int | None = None  # calls of this tool in flight at once, process-wide per executor
    depends_on: tuple[str, ...] = ()  # in one step, calls of this tool start after calls of these tools end
    is_async: bool = False

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"tool name {self.name!r} must be 1-64 characters of [A-Za-z0-9_-] (OpenAI's rule)")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"tool {self.name}: timeout_s must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"tool {self.name}: max_concurrency must be >= 1")

    @property
    def parameters(self) -> dict[str, Any]:
        """JSON schema of the arguments object."""
        schema = self.args_model.model_json_schema()
        schema.pop("title", None)
        return schema

    def openai_schema(self) -> dict[str, Any]:
        """The entry for the `tools` field of a chat request."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def parse_arguments(self, arguments: str | dict[str, Any]) -> dict[str, Any]:
        """Model-sent arguments (JSON text or a dict) to keyword arguments; ToolArgumentsError if invalid."""
        if isinstance(arguments, str):
            try:
                raw = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                raise ToolArgumentsError(f"arguments are not valid JSON: {exc}") from None
        else:
            raw = arguments
        if not isinstance(raw, dict):
            raise ToolArgumentsError("arguments must be a JSON object")
        try:
            parsed = self.args_model.model_validate(raw)
        except ValidationError as exc:
            errors = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors())
            raise ToolArgumentsError(f"invalid arguments: {errors}") from None
        # Values as validated: a parameter typed as a pydantic model receives the model.
        return {n: getattr(parsed, n) for n in type(parsed).model_fields}


def _args_model(fn: Callable[..., Any], name: str) -> type[BaseModel]:
    """A pydantic model of the function's parameters, from its (resolved) type hints."""
    hints = typing.get_type_hints(fn, include_extras=True)
    fields: dict[str, Any] = {}
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {name}: *args/**kwargs have no schema")
        annotation = hints.get(pname, Any)
        default = ... if param.default is param.empty else param.default
        fields[pname] = (annotation, default)
    # NOTE: extra="forbid" puts additionalProperties: false in the schema, which
    # constrained decoders need to keep a model from inventing parameters.
    return create_model(f"{name}_args", __config__=ConfigDict(extra="forbid"), **fields)


def make_tool(fn: Callable[..., Any], *, name: str | None = None, description: str | None = None,
              timeout_s: float | None = 30.0, is_idempotent: bool = True, max_concurrency: int | None = None,
              depends_on: tuple[str, ...] = ()) -> Tool:
    """A `Tool` from a function: name and description default to the function's name and docstring."""
    tool_name = name or fn.__name__
    model = _args_model(fn, tool_name)
    doc = description if description is not None else inspect.getdoc(fn) or ""
    is_async = asyncio.iscoroutinefunction(fn) or asyncio.iscoroutinefunction(getattr(fn, "__call__", None))
    return Tool(tool_name, fn, doc, model, timeout_s, is_idempotent, max_concurrency, tuple(depends_on), is_async)


class ToolRegistry:
    """Named tools. Register with `registry.add(fn, ...)` or the `@registry.tool(...)` decorator."""

    def __init__(self, tools: list[Tool] | None = None) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools or []:
            self.add_tool(t)

    def add_tool(self, tool: Tool) -> Tool:
        if tool.name in self._tools:
            raise ValueError(f"tool {tool.name!r} is already registered")
        self._tools[tool.name] = tool
        return tool

    def add(self, fn: Callable[..., Any], **options: Any) -> Tool:
        return self.add_tool(make_tool(fn, **options))

    def tool(self, fn: Callable[..., Any] | None = None, **options: Any) -> Any:
        """Decorator, bare (`@registry.tool`) or with options (`@registry.tool(timeout_s=5)`); returns fn."""
        def register(f: Callable[..., Any]) -> Callable[..., Any]:
            self.add(f, **options)
            return f

        return register(fn) if fn is not None else register

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def names(self) -> list[str]:
        return list(self._tools)

    def openai_schemas(self) -> list[dict[str, Any]]:
        return [t.openai_schema() for t in self._tools.values()]
