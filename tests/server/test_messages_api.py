"""POST /v1/messages with the official `anthropic` client (the protocol Claude Code speaks)."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.server.conftest import LiveServer

TOOLS = [{"name": "Bash", "description": "Run a command",
          "input_schema": {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
                           "properties": {"command": {"type": "string", "enum": ["ls", "pwd", "make test"]}},
                           "required": ["command"]}},
         {"type": "web_search_20250305", "name": "web_search"}]  # a server tool: accepted, not offered


def client(server: LiveServer, key: str = "key-alice") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def test_text_message_and_usage(server: LiveServer) -> None:
    assert httpx.head(server.url + "/").status_code == 200  # Claude Code's first contact
    m = client(server).messages.create(model="tiny", max_tokens=12, system=[{"type": "text", "text": "Be brief."}],
                                       messages=[{"role": "user", "content": "hello"}], extra_body={"temperature": 0})
    assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text"
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens <= 12
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 5


def test_tool_use_round_trip_computes_only_the_result(server: LiveServer) -> None:
    c = client(server)
    headers = {"X-Claude-Code-Session-Id": "cc-round-trip"}
    msgs = [{"role": "user", "content": "List the files."}]
    first = c.messages.create(model="tiny", max_tokens=200, tools=TOOLS, tool_choice={"type": "any"},
                              messages=msgs, extra_body={"temperature": 0}, extra_headers=headers)
    use = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and use and use[0].name == "Bash" and use[0].id.startswith("toolu_")
    assert use[0].input["command"] in ("ls", "pwd", "make test")
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "a.py"}]}]
    second = c.messages.create(model="tiny", max_tokens=16, tools=TOOLS, messages=msgs, extra_body={"temperature": 0},
                               extra_headers=headers)
    held = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens
    assert second.usage.cache_read_input_tokens == held - 1  # the model's own reply was not computed again
    assert second.usage.input_tokens < 30


def test_stream_sends_input_json_deltas(server: LiveServer) -> None:
    c = client(server)
    with c.messages.stream(model="tiny", max_tokens=200, tools=TOOLS, tool_choice={"type": "tool", "name": "Bash"},
                           messages=[{"role": "user", "content": "Run the tests."}], extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and "message_stop" in kinds
    deltas = [e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(deltas) > 1  # the arguments stream as they are generated
    block = next(b for b in final.content if b.type == "tool_use")
    assert json.loads("".join(d.delta.partial_json for d in deltas)) == block.input
    assert final.stop_reason == "tool_use"


def test_count_tokens(server: LiveServer) -> None:
    msgs = [{"role": "user", "content": "How many tokens is this?"}]
    n = client(server).messages.count_tokens(model="tiny", messages=msgs, tools=TOOLS).input_tokens
    m = client(server).messages.create(model="tiny", max_tokens=2, messages=msgs, tools=TOOLS)
    assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_claude_code_shapes_are_accepted(server: LiveServer) -> None:
    """What Claude Code sends: system blocks with cache_control, a system message inside `messages`, thinking
    and context-management fields, metadata.user_id as a JSON string, the beta query and headers."""
    body = {"model": "tiny", "max_tokens": 32000, "stream": True,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1;"},
                       {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>today</system-reminder>"},
                                                      {"type": "text", "text": "say hi",
                                                       "cache_control": {"type": "ephemeral"}}]},
                         {"role": "system", "content": "Available agent types: none."}],
            "tools": TOOLS, "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "cc-shape"})},
            "thinking": {"type": "adaptive"}, "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
            "output_config": {"effort": "high"}}
    headers = {"x-api-key": "key-alice", "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}
    with httpx.stream("POST", server.url + "/v1/messages?beta=true", json={**body, "max_tokens": 8}, headers=headers,
                      timeout=120) as r:
        assert r.status_code == 200
        names = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert names.count("content_block_start") == names.count("content_block_stop") >= 1
    # max_tokens past the context is a cap, not an error: the answer stops where the context ends.
    r = httpx.post(server.url + "/v1/messages", json={**body, "stream": False, "max_tokens": 32000,
                                                      "stop_sequences": ["a", "e", "o", " "]},
                   headers=headers, timeout=120)
    assert r.status_code == 200, r.text


def test_errors_are_anthropic_errors(server: LiveServer) -> None:
    c = client(server)
    with pytest.raises(anthropic.NotFoundError):
        c.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError, match="not supported"):
        c.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    with pytest.raises(anthropic.AuthenticationError):
        client(server, "wrong-key").messages.create(model="tiny", max_tokens=4,
                                                    messages=[{"role": "user", "content": "x"}])
    r = httpx.post(server.url + "/v1/messages", json={"model": "tiny", "messages": []},
                   headers={"x-api-key": "key-alice"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_parallel_requests_of_one_session_fork_instead_of_failing(server: LiveServer) -> None:
    """Sub-agents share Claude Code's session header: turns that run at the same time on one conversation fork
    it (each continues the shared history) instead of a 409."""
    import concurrent.futures

    c = client(server)
    headers = {"X-Claude-Code-Session-Id": "cc-parallel"}
    msgs = [{"role": "user", "content": "Plan the work, then split it."}]
    first = c.messages.create(model="tiny", max_tokens=100, tools=TOOLS, tool_choice={"type": "any"}, messages=msgs,
                              extra_body={"temperature": 0}, extra_headers=headers)
    use = next(b for b in first.content if b.type == "tool_use")
    history = msgs + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]}]

    def branch(i: int) -> anthropic.types.Message:
        return c.messages.create(model="tiny", max_tokens=40, extra_headers=headers, extra_body={
            "temperature": 0, "ignore_eos": True}, tools=TOOLS, messages=history + [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": f"part {i}"}]}])

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(branch, range(3)))
    held = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens
    for m in replies:  # every branch continued the shared history: nothing it held was computed again
        assert m.usage.cache_read_input_tokens >= (held - 1) // 16 * 16
