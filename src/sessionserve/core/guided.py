"""Structured-output constraints described as plain data (no torch, no xgrammar).

A `GuidedDecoding` says what shape a request's output must take: any JSON
object, JSON matching a schema, tool calls in the chat template's
`<tool_call>` format, or a regex. It is frozen and hashable so it can sit in
`SamplingParams`; the model side (`sessionserve.model.structured`) compiles
it to a grammar, cached by `spec`.

`spec` is compact JSON that keeps the caller's key order: property order in a
schema is the order the grammar emits fields in, so sorting keys would change
the output, and two schemas that differ only in order are different grammars.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_object", "json_schema", "tool_calls", "regex")
TOOL_MODES = ("required", "named")


@dataclass(frozen=True)
class GuidedDecoding:
    """A constraint on the generated text: `kind` plus its canonical JSON `spec`.

    Build with the constructors (`json_object`, `json_schema`, `tool_calls`,
    `regex`), which validate and canonicalise; invalid input raises ValueError.
    """

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"invalid guided decoding kind {self.kind!r}: must be one of {', '.join(KINDS)}")
        if not isinstance(self.spec, str):
            raise ValueError("guided decoding spec must be a string")
        if self.kind == "json_object" and self.spec:
            raise ValueError("json_object takes no spec")
        if self.kind in ("json_schema", "tool_calls"):
            try:
                value = json.loads(self.spec)
            except (TypeError, json.JSONDecodeError) as exc:
                raise ValueError(f"{self.kind} spec is not valid JSON: {exc}") from None
            if not isinstance(value, dict):
                raise ValueError(f"{self.kind} spec must be a JSON object")
        if self.kind == "regex" and not self.spec:
            raise ValueError("regex pattern must be a non-empty string")

    @staticmethod
    def json_object() -> GuidedDecoding:
        """Any JSON object."""
        return GuidedDecoding("json_object", "")

    @staticmethod
    def json_schema(schema: dict[str, Any]) -> GuidedDecoding:
        """JSON that matches `schema` (a JSON Schema document)."""
        _check_schema(schema, "json_schema")
        return GuidedDecoding("json_schema", _canonical(schema, "json_schema"))

    @staticmethod
    def tool_calls(tools: list[dict[str, Any]], name: str | None = None,
                   parallel: bool = True) -> GuidedDecoding:
        """One (or, if `parallel`, one or more) `<tool_call>` blocks calling `tools`.

        `tools` are OpenAI function tools (`{"type": "function", "function":
        {"name", "parameters"}}`) or bare `{"name", "parameters"}` dicts.
        `name` forces that tool (OpenAI `tool_choice` naming a function);
        None allows any of them (`tool_choice="required"`).
        """
        if not isinstance(tools, (list, tuple)) or not tools:
            raise ValueError("tool_calls needs a non-empty list of tools")
        normalized = [_normalize_tool(t) for t in tools]
        names = [t["name"] for t in normalized]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tool names in {names}")
        if name is not None and name not in names:
            raise ValueError(f"tool {name!r} is not among the tools {names}")
        if not isinstance(parallel, bool):
            raise ValueError("parallel must be a bool")
        spec = {"tools": normalized, "mode": "required" if name is None else "named",
                "name": name, "parallel": parallel}
        return GuidedDecoding("tool_calls", _canonical(spec, "tool_calls"))

    @staticmethod
    def regex(pattern: str) -> GuidedDecoding:
        """Text matching `pattern` (xgrammar's regex dialect; checked at compile time)."""
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("regex pattern must be a non-empty string")
        return GuidedDecoding("regex", pattern)

    def spec_value(self) -> Any:
        """The spec parsed back: a dict for json_schema / tool_calls, the pattern for regex."""
        if self.kind in ("json_schema", "tool_calls"):
            return json.loads(self.spec)
        return self.spec

    def allowed_tools(self) -> list[dict[str, Any]]:
        """For tool_calls: the `{"name", "parameters"}` tools the output may call."""
        if self.kind != "tool_calls":
            raise ValueError(f"{self.kind} has no tools")
        spec = self.spec_value()
        return [t for t in spec["tools"] if spec["mode"] == "required" or t["name"] == spec["name"]]


def _normalize_tool(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise ValueError(f"a tool must be a dict, got {type(tool).__name__}")
    if "function" in tool or "type" in tool:
        if tool.get("type", "function") != "function":
            raise ValueError(f"unsupported tool type {tool.get('type')!r}: only 'function'")
        tool = tool.get("function")
        if not isinstance(tool, dict):
            raise ValueError("a function tool needs a 'function' object")
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"invalid tool name {name!r}: must be a non-empty string")
    params = tool.get("parameters")
    if params is None:
        # OpenAI: omitting parameters declares a function with no arguments.
        params = {"type": "object", "properties": {}}
    _check_schema(params, f"parameters of tool {name!r}")
    return {"name": name, "parameters": params}


def _check_schema(schema: Any, what: str) -> None:
    if not isinstance(schema, dict):
        raise ValueError(f"{what} must be a JSON object (dict), got {type(schema).__name__}")


def _canonical(value: Any, what: str) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} is not JSON-serialisable: {exc}") from None
