"""The official Open Responses schema (spec 2026-04-24), as shipped in the `openresponses-py` wheel.

Every Response object and streaming event the server sends is checked against it with `jsonschema`.
"""

from __future__ import annotations

import json
from functools import cache
from importlib.metadata import distribution
from typing import Any

SPEC_VERSION = "2026-04-24"


@cache
def _spec() -> dict[str, Any]:
    spec = json.loads(distribution("openresponses-py").locate_file(f"openresponses/openapi/{SPEC_VERSION}.json")
                      .read_text("utf-8"))
    assert spec["info"]["version"] == SPEC_VERSION
    return spec


@cache
def _validators() -> tuple[Any, dict[str, Any]]:
    from jsonschema import Draft202012Validator

    spec = _spec()
    components = {"components": spec["components"]}
    response = Draft202012Validator({"$ref": "#/components/schemas/ResponseResource", **components})
    stream = spec["paths"]["/responses"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    events = {}
    for ref in stream["oneOf"]:
        schema = spec["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]
        events[schema["properties"]["type"]["enum"][0]] = Draft202012Validator({"$ref": ref["$ref"], **components})
    return response, events


def _problems(validator: Any, obj: Any) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in validator.iter_errors(obj)]


def response_problems(obj: dict[str, Any]) -> list[str]:
    return _problems(_validators()[0], obj)


def event_problems(obj: dict[str, Any]) -> list[str]:
    events = _validators()[1]
    if obj.get("type") not in events:
        return [f"unknown event type {obj.get('type')!r}"]
    return _problems(events[obj["type"]], obj)


def parse_sse(lines: list[str]) -> list[tuple[str | None, Any]]:
    """(event name, data) pairs of a text/event-stream; data is parsed JSON, or the raw text ([DONE])."""
    out: list[tuple[str | None, Any]] = []
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            raw = line[6:]
            out.append((name, raw if raw == "[DONE]" else json.loads(raw)))
            name = None
    return out
