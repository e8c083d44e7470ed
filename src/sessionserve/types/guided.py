"""Structured-output constraints described as plain data (no torch, no xgrammar).

A `GuidedDecoding` says what shape a request's output must take: any JSON
object, JSON matching a schema, tool calls in the model's `ToolFormat`, or a
regex. It is frozen and hashable so it can sit in `SamplingParams`; the model
side (`sessionserve.model.structured`) compiles it to a grammar, cached by
`spec`.

`ToolFormat` is how a model family writes its tool calls, and
`tool_format_of` reads it off the model's chat template (the template both
shows the model its past calls and tells it how to write new ones).

`spec` is compact JSON that keeps the caller's key order: property order in a
schema is the order the grammar emits fields in, so sorting keys would change
the output, and two schemas that differ only in order are different grammars.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

KINDS = ("json_object", "json_schema", "tool_calls", "regex")
TOOL_MODES = ("required", "named")


class ToolFormat(Enum):
    """How a model family writes tool calls in its output."""

    # `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` per call (Qwen 2.5 / 3, Hermes, the
    # embedded models).
    HERMES = "hermes"
    # `{"name": ..., "parameters": {...}}` as the whole reply, optionally after `<|python_tag|>`, calls
    # separated by `;` (Llama 3.1 - 3.3 with JSON tool calling).
    LLAMA3_JSON = "llama3_json"
    # `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3, Nemo, Small 3: tokenizers
    # before v11).
    MISTRAL = "mistral"
    # `[TOOL_CALLS]name[ARGS]{...}` per call (tokenizer v11 and later: Mistral Small 3.2, Devstral, Magistral).
    MISTRAL_ARGS = "mistral_args"

    @property
    def markers(self) -> tuple[str, ...]:
        """The marker tokens of the format (a tokenizer may hold them as special tokens)."""
        return _MARKERS[self]


_MARKERS = {
    ToolFormat.HERMES: ("<tool_call>", "</tool_call>"),
    ToolFormat.LLAMA3_JSON: ("<|python_tag|>",),
    ToolFormat.MISTRAL: ("[TOOL_CALLS]",),
    ToolFormat.MISTRAL_ARGS: ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
}


def tool_format_of(chat_template: str | None) -> ToolFormat:
    """The tool-call format a chat template renders (and so teaches), from the template's text.

    The first rule that holds wins:
    - `<tool_call>` in the template: HERMES (also Hermes fine-tunes of Llama or Mistral models);
    - `[TOOL_CALLS]`: MISTRAL_ARGS if `[ARGS]` is there too, else MISTRAL;
    - Llama 3 headers (`<|start_header_id|>`) with `<|python_tag|>` or assistant `tool_calls`: LLAMA3_JSON;
    - otherwise (no template, a template without tools): HERMES, the embedded models' format.
    """
    text = chat_template or ""
    if "<tool_call>" in text:
        return ToolFormat.HERMES
    if "[TOOL_CALLS]" in text:
        return ToolFormat.MISTRAL_ARGS if "[ARGS]" in text else ToolFormat.MISTRAL
    if "<|start_header_id|>" in text and ("<|python_tag|>" in text or "tool_calls" in text):
        return ToolFormat.LLAMA3_JSON
    return ToolFormat.HERMES


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
            if self.kind == "tool_calls" and "format" in value:
                ToolFormat(value["format"])  # ValueError for an unknown format
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
                   parallel: bool = True, format: ToolFormat | None = None,
                   answer: GuidedDecoding | None = None) -> GuidedDecoding:
        """One (or, if `parallel`, one or more) tool calls of `tools`, written in `format`.

        `tools` are OpenAI function tools (`{"type": "function", "function":
        {"name", "parameters"}}`) or bare `{"name", "parameters"}` dicts.
        `name` forces that tool (OpenAI `tool_choice` naming a function);
        None allows any of them (`tool_choice="required"`). `format` None:
        the format of the model that runs the request (its chat template's).
        `answer` (a json_object or json_schema constraint): the output is either the calls or an answer of
        that shape (tools offered with `tool_choice` auto and a response format: one grammar for both).
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
        if format is not None and not isinstance(format, ToolFormat):
            raise ValueError(f"format must be a ToolFormat, got {format!r}")
        spec: dict[str, Any] = {"tools": normalized, "mode": "required" if name is None else "named",
                                "name": name, "parallel": parallel}
        if format is not None:
            spec["format"] = format.value
        if answer is not None:
            if answer.kind not in ("json_object", "json_schema"):
                raise ValueError("a tool call's alternative answer must be json_object or json_schema")
            spec["answer"] = answer.spec_value() if answer.kind == "json_schema" else None
            spec["mode"] = "auto"
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
        return [t for t in spec["tools"] if spec["mode"] != "named" or t["name"] == spec["name"]]

    def answer(self) -> GuidedDecoding | None:
        """For tool_calls: the shape of the answer the output may give instead of calls (None: calls only)."""
        if self.kind != "tool_calls":
            raise ValueError(f"{self.kind} has no alternative answer")
        spec = self.spec_value()
        if "answer" not in spec:
            return None
        return GuidedDecoding.json_object() if spec["answer"] is None else GuidedDecoding.json_schema(spec["answer"])

    def tool_format(self) -> ToolFormat | None:
        """For tool_calls: the format the calls are written in; None: the model's own."""
        if self.kind != "tool_calls":
            raise ValueError(f"{self.kind} has no tool format")
        value = self.spec_value().get("format")
        return None if value is None else ToolFormat(value)


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
