"""GuidedDecoding: constructors, canonical specs, validation and hashability (pure, no model)."""

from __future__ import annotations

import json

import pytest

from sessionserve.types.guided import GuidedDecoding
from sessionserve.types.sampling_params import SamplingParams

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ADD = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}


def test_json_object_and_schema() -> None:
    assert GuidedDecoding.json_object() == GuidedDecoding("json_object", "")
    g = GuidedDecoding.json_schema(ADD)
    assert g.kind == "json_schema" and g.spec_value() == ADD
    # Key order is kept: it is the order the grammar emits properties in.
    assert g.spec == '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"integer"}}}'


def test_tool_calls_accepts_openai_and_bare_tools() -> None:
    openai = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
              {"type": "function", "function": {"name": "add", "parameters": ADD, "description": "x"}}]
    bare = [{"name": "weather", "parameters": WEATHER}, {"name": "add", "parameters": ADD}]
    g = GuidedDecoding.tool_calls(openai)
    assert g == GuidedDecoding.tool_calls(bare)
    spec = g.spec_value()
    assert spec["mode"] == "required" and spec["name"] is None and spec["parallel"] is True
    assert spec["tools"] == bare  # descriptions dropped: they do not change the grammar
    assert [t["name"] for t in g.allowed_tools()] == ["weather", "add"]


def test_named_tool_and_parallel() -> None:
    tools = [{"name": "weather", "parameters": WEATHER}, {"name": "add", "parameters": ADD}]
    g = GuidedDecoding.tool_calls(tools, name="add", parallel=False)
    spec = json.loads(g.spec)
    assert spec["mode"] == "named" and spec["name"] == "add" and spec["parallel"] is False
    assert g.allowed_tools() == [{"name": "add", "parameters": ADD}]
    assert g != GuidedDecoding.tool_calls(tools, name="add")


def test_missing_parameters_mean_no_arguments() -> None:
    g = GuidedDecoding.tool_calls([{"type": "function", "function": {"name": "now"}}])
    assert g.allowed_tools() == [{"name": "now", "parameters": {"type": "object", "properties": {}}}]


def test_regex() -> None:
    assert GuidedDecoding.regex(r"[a-z]+").spec == "[a-z]+"


@pytest.mark.parametrize("build", [
    lambda: GuidedDecoding("xml", ""),
    lambda: GuidedDecoding("json_object", "{}"),
    lambda: GuidedDecoding("json_schema", "not json"),
    lambda: GuidedDecoding("json_schema", "[1]"),
    lambda: GuidedDecoding.json_schema([{"type": "object"}]),  # type: ignore[arg-type]
    lambda: GuidedDecoding.json_schema({"x": float("nan")}),
    lambda: GuidedDecoding.json_schema({"x": {1, 2}}),
    lambda: GuidedDecoding.tool_calls([]),
    lambda: GuidedDecoding.tool_calls([{"name": ""}]),
    lambda: GuidedDecoding.tool_calls([{"parameters": WEATHER}]),
    lambda: GuidedDecoding.tool_calls([{"type": "code_interpreter"}]),
    lambda: GuidedDecoding.tool_calls([{"type": "function"}]),
    lambda: GuidedDecoding.tool_calls([{"name": "a", "parameters": "x"}]),
    lambda: GuidedDecoding.tool_calls([{"name": "a"}, {"name": "a"}]),
    lambda: GuidedDecoding.tool_calls([{"name": "a"}], name="b"),
    lambda: GuidedDecoding.tool_calls([{"name": "a"}], parallel="yes"),  # type: ignore[arg-type]
    lambda: GuidedDecoding.regex(""),
    lambda: GuidedDecoding.json_object().allowed_tools(),
])
def test_invalid_input_raises_value_error(build) -> None:  # noqa: ANN001
    with pytest.raises(ValueError):
        build()


def test_hashable_and_usable_in_sampling_params() -> None:
    a = GuidedDecoding.json_schema({"type": "object", "properties": {"x": {"enum": [1, 2]}}})
    b = GuidedDecoding.json_schema({"type": "object", "properties": {"x": {"enum": [1, 2]}}})
    assert a == b and hash(a) == hash(b) and len({a, b, GuidedDecoding.json_object()}) == 2
    params = SamplingParams(guided=a)
    assert params.guided is a and hash(params.guided) == hash(b)
    with pytest.raises(ValueError, match="guided"):
        SamplingParams(guided={"type": "json_object"})  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        a.kind = "regex"  # type: ignore[misc]
