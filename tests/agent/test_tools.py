"""The tool registry: schemas from type hints and pydantic models, argument validation, options."""

from __future__ import annotations

from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

from sessionserve.agent.tools import Tool, ToolArgumentsError, ToolRegistry, make_tool


class Query(BaseModel):
    text: str
    limit: int = 3


def search(query: Query, mode: Literal["fast", "exact"] = "fast") -> list[str]:
    """Search the index."""
    return [query.text] * query.limit


def test_schema_from_hints() -> None:
    def grep(pattern: Annotated[str, Field(max_length=20)], path: str = ".", max_results: int = 20,
             is_regex: bool = False, exts: list[str] | None = None) -> list[str]:
        """Search files for a pattern."""
        return []

    spec = make_tool(grep).openai_schema()
    fn = spec["function"]
    assert spec["type"] == "function" and fn["name"] == "grep" and fn["description"] == "Search files for a pattern."
    params = fn["parameters"]
    assert params["type"] == "object" and params["required"] == ["pattern"]
    assert params["additionalProperties"] is False
    props = params["properties"]
    assert props["pattern"]["type"] == "string" and props["pattern"]["maxLength"] == 20
    assert props["max_results"] == {"default": 20, "title": "Max Results", "type": "integer"}
    assert props["is_regex"]["type"] == "boolean"
    assert {"type": "array", "items": {"type": "string"}} in props["exts"]["anyOf"]


def test_pydantic_parameter_and_enum() -> None:
    tool = make_tool(search)
    params = tool.parameters
    assert params["properties"]["mode"]["enum"] == ["fast", "exact"]
    assert "$defs" in params and params["required"] == ["query"]
    args = tool.parse_arguments('{"query": {"text": "x", "limit": 2}}')
    assert isinstance(args["query"], Query) and args["query"].limit == 2 and args["mode"] == "fast"
    assert tool.fn(**args) == ["x", "x"]


@pytest.mark.parametrize("raw, msg", [
    ("{not json", "not valid JSON"), ("[1, 2]", "JSON object"), ('{"query": {"limit": 2}}', "query.text"),
    ('{"query": {"text": "x"}, "extra": 1}', "extra"), ('{"query": {"text": "x"}, "mode": "slow"}', "mode"),
])
def test_bad_arguments_are_not_retryable_errors(raw: str, msg: str) -> None:
    with pytest.raises(ToolArgumentsError, match=msg) as info:
        make_tool(search).parse_arguments(raw)
    assert info.value.is_retryable is False


def test_empty_arguments_mean_no_arguments() -> None:
    def ping() -> str:
        return "pong"

    assert make_tool(ping).parse_arguments("") == {}
    assert make_tool(ping).parameters["properties"] == {}


def test_registry_decorators_options_and_async_detection() -> None:
    tools = ToolRegistry()

    @tools.tool
    def a(x: int) -> int:
        return x

    @tools.tool(timeout_s=2.0, is_idempotent=False, max_concurrency=2, depends_on=("a",), name="bee")
    async def b(y: str) -> str:
        return y

    assert tools.names() == ["a", "bee"] and len(tools) == 2 and "bee" in tools
    assert a(3) == 3  # the decorator returns the function
    tb = tools["bee"]
    assert tb.is_async and not tools["a"].is_async
    assert (tb.timeout_s, tb.is_idempotent, tb.max_concurrency, tb.depends_on) == (2.0, False, 2, ("a",))
    assert [s["function"]["name"] for s in tools.openai_schemas()] == ["a", "bee"]
    with pytest.raises(ValueError, match="already registered"):
        tools.add(a)


def test_invalid_tools_are_rejected() -> None:
    def f(x: int) -> int:
        return x

    def g(*args: int) -> int:
        return 0

    with pytest.raises(ValueError, match="name"):
        make_tool(f, name="has space")
    with pytest.raises(ValueError, match="timeout_s"):
        make_tool(f, timeout_s=0)
    with pytest.raises(ValueError, match="max_concurrency"):
        make_tool(f, max_concurrency=0)
    with pytest.raises(TypeError):
        make_tool(g)
    assert isinstance(make_tool(f), Tool)
