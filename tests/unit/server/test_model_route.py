"""Step routing between a large and a small model (pure policy)."""

from __future__ import annotations

import json

from sessionserve.server.model_route import (
    EXECUTE,
    ModelRoutePolicy,
    StepView,
    looks_like_error,
    step_view,
    validate_tool_calls,
)

POLICY = ModelRoutePolicy(large="big", small="little")
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def call(name: str, args: str) -> dict:
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": args}}


def convo(*tail: dict) -> list[dict]:
    return [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Fix the failing test."}, *tail]


def test_plan_steps_go_large_execute_steps_go_small() -> None:
    first = step_view(convo())
    assert first == StepView(0, "user", False) and POLICY.choose(first) == ("big", "first step")
    read = {"role": "assistant", "content": None, "tool_calls": [call("read_file", '{"path": "a.py"}')]}
    ok = step_view(convo(read, {"role": "tool", "tool_call_id": "c1", "content": "def f():\n    return 1\n"}))
    assert POLICY.classify(ok)[0] == EXECUTE and POLICY.choose(ok)[0] == "little"
    failed = step_view(convo(read, {"role": "tool", "tool_call_id": "c1",
                                    "content": "Traceback (most recent call last):\n  ...\nKeyError: 'x'"}))
    assert POLICY.choose(failed) == ("big", "after a tool error")
    follow_up = step_view(convo(read, {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "Done."},
                                {"role": "user", "content": "Now add a test."}))
    assert POLICY.choose(follow_up) == ("big", "after a user message")


def test_an_old_tool_error_does_not_make_later_steps_plan_steps() -> None:
    read = {"role": "assistant", "content": None, "tool_calls": [call("read_file", "{}")]}
    msgs = convo(read, {"role": "tool", "content": "Error: no such file"}, read, {"role": "tool", "content": "x = 1"})
    assert POLICY.classify(step_view(msgs))[0] == EXECUTE


def test_escalation_keeps_the_session_large_for_a_few_steps() -> None:
    view = StepView(3, "tool", False)
    assert POLICY.choose(view, steps_since_escalation=0)[0] == "big"
    assert POLICY.choose(view, steps_since_escalation=1)[0] == "big"
    assert POLICY.choose(view, steps_since_escalation=2)[0] == "little"
    assert POLICY.choose(view, steps_since_escalation=None)[0] == "little"


def test_error_detection() -> None:
    for text in ("Error: file not found", "bash: foo: command not found", "Process exited with exit code 2",
                 "Traceback (most recent call last):", "HTTP 404 Client Error", "  exception raised"):
        assert looks_like_error(text), text
    for text in ("0 errors found", "all tests passed", "def error_handler(): pass", "exit code 0"):
        assert not looks_like_error(text), text


def test_tool_call_validation() -> None:
    assert validate_tool_calls([call("read_file", json.dumps({"path": "a"}))], TOOLS) is None
    assert "not offered" in validate_tool_calls([call("rm", "{}")], TOOLS)
    assert "not JSON" in validate_tool_calls([call("read_file", "{path: a")], TOOLS)
    assert "not a JSON object" in validate_tool_calls([call("read_file", "[1]")], TOOLS)
    assert "missing path" in validate_tool_calls([call("read_file", "{}")], TOOLS)
    assert validate_tool_calls([], TOOLS) is None

