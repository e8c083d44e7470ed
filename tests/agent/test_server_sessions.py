"""The runtime against `sessionserve` itself (tiny random model): sessions park while tools run, then resume.

The random-weight model calls tools only under constrained decoding, so the
first step forces them (`tool_choice="required"`) and the next one answers.
"""

from __future__ import annotations

import asyncio
import io
import sys
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any, Literal

import httpx

from sessionserve.agent import Agent, AgentConfig, ChatClient, RetryBudget, ToolRegistry
from tests.server.conftest import LiveServer

AUTH = {"Authorization": "Bearer key-alice"}
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def session_tools(server: LiveServer, sid: str, seen: list[dict[str, Any]]) -> ToolRegistry:
    tools = ToolRegistry()

    @tools.tool(timeout_s=10)
    def check_status(component: Literal["db", "cache"]) -> str:
        """Health of a component."""
        # While the tool runs, the server holds the session parked.
        seen.append(httpx.get(f"{server.url}/v1/sessions/{sid}", headers=AUTH).json())
        seen[-1]["wait_hint_s"] = server.call(lambda eng: eng.get_session(f"alice/{sid}").wait_hint_s)
        return f"{component}: healthy"

    return tools


def test_session_parks_during_tools_and_resumes(server: LiveServer) -> None:
    sid, seen = "agent-test-1", []
    client = ChatClient(server.url + "/v1", "key-alice", model="tiny", budget=RetryBudget())
    agent = Agent(client, session_tools(server, sid, seen),
                  AgentConfig(tool_choice=["required", "none"], max_steps=3,
                              model_params={"max_tokens": 60, "temperature": 0}))
    agent.estimator.observe("check_status", 0.75)  # learnt earlier: announced with the first park

    async def main() -> Any:
        result = await agent.run("Is the database healthy?", session_id=sid)
        agent.close()
        await client.aclose()
        return result

    result = asyncio.run(main())
    assert result.session_id == sid and result.stop_reason == "answer", result
    step0, step1 = result.steps
    assert step0.tool_calls and step0.expected_wait_s == 0.75
    assert seen and all(s["state"] == "parked" and s["waiting_tools"] == ["check_status"] for s in seen)
    assert seen[0]["wait_hint_s"] == 0.75 and seen[0]["steps"] == 1
    # Resumed from the session's KV: the second turn reused the first turn's tokens.
    assert step1.num_cached_tokens > 0
    assert result.messages[2]["role"] == "tool" and result.messages[2]["content"] in ("db: healthy", "cache: healthy")
    closed = httpx.get(f"{server.url}/v1/sessions/{sid}", headers=AUTH)
    assert closed.status_code == 404  # the run closed its session


def test_streaming_run_keeps_the_session_and_learns_the_wait(server: LiveServer) -> None:
    sid, seen = "agent-test-2", []
    client = ChatClient(server.url + "/v1", "key-alice", model="tiny", budget=RetryBudget())
    agent = Agent(client, session_tools(server, sid, seen),
                  AgentConfig(tool_choice=["required", "required", "none"], max_steps=4, stream=True,
                              close_session=False, priority="batch",
                              model_params={"max_tokens": 60, "temperature": 0}))

    async def main() -> Any:
        result = await agent.run("Check the cache twice.", session_id=sid)
        info = await client.get_session(sid)
        await client.close_session(sid)
        agent.close()
        await client.aclose()
        return result, info

    result, info = asyncio.run(main())
    assert result.stop_reason == "answer" and len(result.steps) == 3
    assert result.steps[0].expected_wait_s is None  # nothing learnt yet
    learnt = result.steps[1].expected_wait_s
    assert learnt is not None and learnt > 0 and seen[1]["wait_hint_s"] == round(learnt, 3)
    assert info["state"] == "parked" and info["steps"] == 3 and info["priority"] == "batch"
    assert result.steps[2].num_cached_tokens > 0 and info["stats"]["num_recompute_tokens"] == 0


def test_example_coding_agent_against_sessionserve(server: LiveServer, tmp_path: Path) -> None:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import coding_agent
    finally:
        sys.path.remove(str(EXAMPLES))
    (tmp_path / "budget.py").write_text("class RetryBudget:\n    ratio = 0.1\n")
    out = io.StringIO()
    with redirect_stdout(out):
        code = coding_agent.main(["--base-url", server.url + "/v1", "--api-key", "key-alice", "--model", "tiny",
                                  "--root", str(tmp_path), "--serve-dir", str(tmp_path),
                                  "--tool-choice", "required,none", "--max-tokens", "120"])
    text = out.getvalue()
    assert code == 0, text
    assert "server: session agent-" in text and "stop: answer" in text and "steps: 2" in text, text
    assert "tool calls: 0" not in text, text


def test_example_tools_directly(tmp_path: Path) -> None:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import coding_agent
    finally:
        sys.path.remove(str(EXAMPLES))
    (tmp_path / "a.py").write_text("x = 1\nclass RetryBudget:\n    pass\n")
    tools = coding_agent.build_tools(tmp_path)
    assert tools["search_files"].fn("class Retry") == ["a.py:2: class RetryBudget:"]
    assert coding_agent.calculator("17 * 23 + 2 ** 3 - (1 / 4)") == 398.75
    for bad in ("__import__('os')", "2 ** 1000", "1 / 0", "x + 1"):
        try:
            coding_agent.calculator(bad)
        except Exception as exc:  # noqa: BLE001
            assert type(exc).__name__ == "ToolError", bad
        else:
            raise AssertionError(bad)
    with coding_agent.file_server(tmp_path) as url:
        assert asyncio.run(coding_agent.http_get(url + "a.py")).startswith("HTTP 200\nx = 1")
    try:
        asyncio.run(coding_agent.http_get("http://example.com/"))
    except Exception as exc:  # noqa: BLE001
        assert "127.0.0.1" in str(exc)
    else:
        raise AssertionError("non-local URL allowed")
