"""Two models behind one server: `model: "auto"` routes plan steps to the large one, execution steps to the small."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sessionserve import LLMEngine
from sessionserve.config import Config
from sessionserve.server.app import create_app
from sessionserve.server.auth import Auth
from sessionserve.server.model_route import ModelRoutePolicy
from sessionserve.server.turn import model_choice
from sessionserve.server.turn import pipeline as turn_pipeline
from sessionserve.server.turn.types import ToolCall
from tests.server.conftest import KEYS, run_app

AUTH = {"Authorization": "Bearer key-alice"}
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
SYSTEM = {"role": "system", "content": "You are a coding agent. Use the tools."}


def _engine(path: Path) -> LLMEngine:
    return LLMEngine(Config.from_kwargs(num_blocks=192, block_size=16, max_num_seqs=8), path)


@pytest.fixture(scope="module")
def two_models(tiny_models: dict[str, Path]) -> Iterator[tuple[str, dict[str, LLMEngine]]]:
    engines = {"large": _engine(tiny_models["llama"]), "small": _engine(tiny_models["qwen3"])}
    app = create_app(engines, auth=Auth(KEYS), route=ModelRoutePolicy(large="large", small="small"))
    with run_app(app) as url:
        yield url, engines


def _chat(url: str, messages: list[dict], model: str = "auto", **extra: object) -> httpx.Response:
    body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120)


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}(?:_total)?\{{(.*)\}} ([0-9.e+]+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _tool_step(messages: list[dict], result: str) -> list[dict]:
    call = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
    return messages + [{"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": result}]


def test_models_lists_every_model_and_auto(two_models: tuple[str, dict[str, LLMEngine]]) -> None:
    url, _ = two_models
    data = httpx.get(url + "/v1/models", headers=AUTH).json()["data"]
    assert [m["id"] for m in data] == ["large", "small", "auto"]
    assert data[2]["routes"] == {"plan": "large", "execute": "small"}
    # A model can also be named directly; an unknown one is a 404 in OpenAI's shape.
    assert _chat(url, [{"role": "user", "content": "hi"}], model="small").json()["model"] == "small"
    r = _chat(url, [{"role": "user", "content": "hi"}], model="medium")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_plan_steps_go_large_execution_steps_small(two_models: tuple[str, dict[str, LLMEngine]]) -> None:
    url, _ = two_models
    msgs = [SYSTEM, {"role": "user", "content": "fix the bug in a.py"}]
    first = _chat(url, msgs, tools=TOOLS)
    assert first.status_code == 200 and first.json()["model"] == "large"
    assert first.headers["x-sessionserve-route"] == "large; first step"
    ok = _chat(url, _tool_step(msgs, "def f():\n    return 1\n"), tools=TOOLS)
    assert ok.json()["model"] == "small" and ok.headers["x-sessionserve-route"] == "small; after tool results"
    failed = _chat(url, _tool_step(msgs, "Traceback (most recent call last):\n  ...\nKeyError: 'x'"), tools=TOOLS)
    assert failed.json()["model"] == "large" and "tool error" in failed.headers["x-sessionserve-route"]
    user = _chat(url, _tool_step(msgs, "ok") + [{"role": "assistant", "content": "done"},
                                               {"role": "user", "content": "now add a test"}], tools=TOOLS)
    assert user.json()["model"] == "large"
    # Streaming follows the same route, with the header on the stream.
    with httpx.stream("POST", url + "/v1/chat/completions", headers=AUTH, timeout=120,
                      json={"model": "auto", "messages": _tool_step(msgs, "fine"), "tools": TOOLS,
                            "max_tokens": 6, "temperature": 0, "stream": True}) as r:
        body = r.read().decode()
        assert r.headers["x-sessionserve-route"].startswith("small;")
    assert '"model": "small"' in body and body.rstrip().endswith("data: [DONE]")
    assert _metric(url, "sessionserve_route_steps", routed_to="small") >= 2


def test_a_session_moves_between_models_without_losing_context(
        two_models: tuple[str, dict[str, LLMEngine]]) -> None:
    url, engines = two_models
    headers = {**AUTH, "X-Session-ID": "mover"}
    msgs = [SYSTEM, {"role": "user", "content": "rename the helper in utils.py and update its callers"}]

    def step(messages: list[dict]) -> dict:
        r = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=120,
                       json={"model": "auto", "messages": messages, "tools": TOOLS, "max_tokens": 8,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    first = step(msgs)  # large
    msgs = _tool_step(msgs + [], "def helper(x):\n    return x\n")
    second = step(msgs)  # small: its engine had nothing of this session yet
    assert second["model"] == "small"
    msgs = msgs + [{"role": "assistant", "content": second["choices"][0]["message"]["content"] or "ok"},
                   {"role": "user", "content": "also update the docs"}]
    third = step(msgs)  # back on the large model: only what it lacks is prefilled
    assert third["model"] == "large"
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 16
    info = httpx.get(url + "/v1/sessions/mover", headers=AUTH).json()
    assert info["model"] == "large" and sorted(info["models"]) == ["large", "small"]
    # A fork copies the session in every engine that holds it.
    fork = httpx.post(url + "/v1/sessions/mover/fork", json={"session_id": "mover-child"}, headers=AUTH)
    assert fork.status_code == 200 and fork.json()["forked_from"] == "mover"
    child = httpx.get(url + "/v1/sessions/mover-child", headers=AUTH).json()
    assert sorted(child["models"]) == ["large", "small"]
    again = httpx.post(url + "/v1/sessions/mover/fork", json={"session_id": "mover-child"}, headers=AUTH)
    assert again.status_code == 409
    assert httpx.delete(url + "/v1/sessions/mover-child", headers=AUTH).status_code == 200
    assert httpx.delete(url + "/v1/sessions/mover", headers=AUTH).status_code == 200
    assert httpx.get(url + "/v1/sessions/mover", headers=AUTH).status_code == 404
    for eng in engines.values():
        assert eng.get_session("alice/mover") is None


def test_an_invalid_small_answer_escalates_to_the_large_model(
        two_models: tuple[str, dict[str, LLMEngine]], monkeypatch: pytest.MonkeyPatch) -> None:
    url, _ = two_models
    before = _metric(url, "sessionserve_route_escalations")
    monkeypatch.setattr(turn_pipeline, "answer_problem", lambda *a: "invalid tool call: 'read_file' is missing path")
    msgs = _tool_step([SYSTEM, {"role": "user", "content": "look at a.py"}], "print('hi')")
    headers = {**AUTH, "X-Session-ID": "escalating"}
    r = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=120,
                   json={"model": "auto", "messages": msgs, "tools": TOOLS, "max_tokens": 8, "temperature": 0})
    body = r.json()
    assert body["model"] == "large" and body["escalated_from"] == "small"
    assert r.headers["x-sessionserve-route"].startswith("large; escalated: invalid tool call")
    assert _metric(url, "sessionserve_route_escalations") == before + 1
    # The session stays on the large model for the policy's cooldown, even for execution steps.
    monkeypatch.undo()
    again = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=120,
                       json={"model": "auto", "messages": _tool_step(msgs, "more"), "tools": TOOLS, "max_tokens": 4,
                             "temperature": 0})
    assert again.json()["model"] == "large" and again.headers["x-sessionserve-route"] == "large; recent escalation"


def test_answer_problem_reasons() -> None:
    tools = [t["function"] for t in TOOLS]
    call = ToolCall("call_1", "read_file", '{"path": "a"}')
    assert model_choice.answer_problem("", None, [call], tools, "auto") is None
    bad = ToolCall("call_2", "read_file", "{}")
    assert "missing path" in model_choice.answer_problem("", None, [bad], tools, "auto")
    other = ToolCall("call_3", "rm", "{}")
    assert "not offered" in model_choice.answer_problem("", None, [other], tools, "auto")
    assert model_choice.answer_problem("<tool_call>{oops", "<tool_call>{oops", [], tools, "auto") \
        == "malformed tool call"
    assert model_choice.answer_problem("hello", "hello", [], tools, "required") == "no tool call"
    assert model_choice.answer_problem("hello", "hello", [], tools, "auto") is None


def test_create_app_checks_names_and_route() -> None:
    with pytest.raises(ValueError, match="at least one"):
        create_app({})
    with pytest.raises(ValueError, match="reserved"):
        create_app({"auto": object()})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="not all served"):
        create_app({"a": object(), "b": object()},  # type: ignore[dict-item]
                   route=ModelRoutePolicy(large="a", small="c"))
    with pytest.raises(ValueError, match="implicit_sessions"):
        create_app({"a": object()}, implicit_sessions="sometimes")  # type: ignore[dict-item]
