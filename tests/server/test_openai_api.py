"""The official `openai` client against a live server on 127.0.0.1 (tiny model)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.server.conftest import LiveServer

TOOLS = [
    {"type": "function", "function": {"name": "search_code", "description": "Search the repository",
                                      "parameters": {"type": "object", "properties": {
                                          "query": {"type": "string", "maxLength": 40},
                                          "max_results": {"type": "integer", "minimum": 1, "maximum": 50}},
                                          "required": ["query"]}}},
    {"type": "function", "function": {"name": "run_tests", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "maxLength": 40}}, "required": ["path"]}}},
]


def client(server: LiveServer, key: str = "key-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_models_and_health(server: LiveServer) -> None:
    assert [m.id for m in client(server).models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_chat_completion_sync(server: LiveServer) -> None:
    resp = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
        max_tokens=8, temperature=0, seed=1)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens <= 8 and resp.usage.prompt_tokens > 5
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_completion_async_concurrent(server: LiveServer) -> None:
    async def main() -> list[str]:
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="key-alice", max_retries=0)
        rs = await asyncio.gather(*[c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"task {i}"}], max_tokens=6, temperature=0)
            for i in range(4)])
        return [r.choices[0].message.content for r in rs]

    assert len(asyncio.run(main())) == 4


def test_streaming_matches_non_streaming_and_reports_usage(server: LiveServer) -> None:
    c = client(server)
    msgs = [{"role": "user", "content": "count"}]
    full = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == (full.choices[0].message.content or "")
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_required_tool_choice_gives_valid_tool_calls(server: LiveServer) -> None:
    resp = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "find the config parser"}], tools=TOOLS,
        tool_choice="required", max_tokens=120, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    for call in choice.message.tool_calls:
        assert call.function.name in ("search_code", "run_tests") and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        assert isinstance(args, dict) and ("query" in args or "path" in args)


def test_named_tool_choice_streams_tool_call_deltas(server: LiveServer) -> None:
    stream = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "run the tests"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "run_tests"}}, max_tokens=120, temperature=0.7,
        seed=3, stream=True)
    names, args, finish = [], "", None
    for ch in stream:
        delta = ch.choices[0].delta
        for tc in delta.tool_calls or []:
            if tc.function and tc.function.name:
                names.append(tc.function.name)
            if tc.function and tc.function.arguments:
                args += tc.function.arguments
        finish = ch.choices[0].finish_reason or finish
    assert names and set(names) == {"run_tests"} and finish == "tool_calls"
    pieces = [tc.function.arguments for ch in client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "run the tests"}], tools=TOOLS, tool_choice="required",
        max_tokens=120, temperature=0.7, seed=3, stream=True) for tc in ch.choices[0].delta.tool_calls or []
        if tc.function and tc.function.arguments]
    assert len(pieces) > 1 and json.loads("".join(pieces))  # arguments stream as they are generated


def test_a_tool_call_cut_by_the_token_limit_is_not_a_call(server: LiveServer) -> None:
    """Cut inside its first call: finish_reason length, no tool_calls, and none of the markup in the content,
    streamed or not."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "search"}], tools=TOOLS, tool_choice="required",
              max_tokens=12, temperature=0)
    r = client(server).chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    assert "<tool_call>" not in (r.choices[0].message.content or "")
    chunks = list(client(server).chat.completions.create(**kw, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call>" not in text and chunks[-1].choices[0].finish_reason == "length"


def test_json_response_format(server: LiveServer) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30},
                                               "confidence": {"type": "integer", "minimum": 0, "maximum": 10}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    resp = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "answer in JSON"}], max_tokens=150, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    data = json.loads(resp.choices[0].message.content)
    assert set(data) == {"answer", "confidence"} and isinstance(data["confidence"], int)


def test_multi_turn_session_with_tool_results_parks_and_resumes(server: LiveServer) -> None:
    c = client(server)
    headers = {"X-Session-ID": "agent-1"}
    msgs = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "fix the bug"}]
    first = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice="required",
                                      max_tokens=120, temperature=0, extra_headers=headers,
                                      extra_body={"expected_wait_s": 2.0})
    calls = first.choices[0].message.tool_calls
    assert calls
    info = httpx.get(server.url + "/v1/sessions/agent-1", headers={"Authorization": "Bearer key-alice"}).json()
    assert info["state"] == "parked" and info["steps"] == 1 and info["waiting_tools"]
    msgs.append(first.choices[0].message.model_dump(exclude_none=True))
    msgs += [{"role": "tool", "tool_call_id": tc.id, "content": "src/config.py:12: def parse_config"} for tc in calls]
    second = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=8, temperature=0,
                                       extra_headers=headers)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > first.usage.prompt_tokens // 2, (cached, first.usage.prompt_tokens)
    info = httpx.get(server.url + "/v1/sessions/agent-1", headers={"Authorization": "Bearer key-alice"}).json()
    assert info["steps"] == 2 and info["stats"]["num_recompute_tokens"] == 0
    gone = httpx.delete(server.url + "/v1/sessions/agent-1", headers={"Authorization": "Bearer key-alice"})
    assert gone.json()["deleted"] is True


def test_completions_endpoint(server: LiveServer) -> None:
    c = client(server)
    resp = c.completions.create(model="tiny", prompt="def parse(", max_tokens=5, temperature=0)
    assert resp.choices[0].finish_reason in ("stop", "length") and resp.usage.completion_tokens <= 5
    chunks = list(c.completions.create(model="tiny", prompt="def parse(", max_tokens=5, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == resp.choices[0].text


def test_errors_have_openai_shape_and_status(server: LiveServer) -> None:
    c = client(server)
    with pytest.raises(openai.NotFoundError) as nf:
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert nf.value.body["param"] == "model" if isinstance(nf.value.body, dict) else True
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2)
    with pytest.raises(openai.BadRequestError) as long:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 5000}])
    assert "context" in str(long.value)
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").models.list()
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                   headers={"Authorization": "Bearer key-alice", "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "wizard"}]},
                   headers={"Authorization": "Bearer key-alice"})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")


def test_priority_field_and_header(server: LiveServer) -> None:
    c = client(server)
    msgs = [{"role": "user", "content": "hi"}]
    ok = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, extra_body={"priority": "batch"})
    assert ok.usage.completion_tokens == 2
    ok = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2,
                                   extra_headers={"X-Priority": "interactive"})
    assert ok.usage.completion_tokens == 2
    for kwargs in ({"extra_body": {"priority": "urgent"}}, {"extra_headers": {"X-Priority": "urgent"}}):
        with pytest.raises(openai.BadRequestError) as bad:
            c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, **kwargs)
        assert bad.value.body["param"] == "priority"


def _free_blocks(server: LiveServer) -> int:
    return server.call(lambda e: e.kv.num_free_blocks)


def test_disconnect_mid_stream_frees_blocks(server: LiveServer) -> None:
    baseline = _free_blocks(server)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "write a long story"}], "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    for _ in range(3):
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                          headers={"Authorization": "Bearer key-alice"}) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i > 6:
                    break
    def orphans(e: object) -> set[str]:
        # Block tables not owned by a live session: what an aborted request would leak.
        return set(e.kv.block_tables) - {s.kv_key for s in e.sessions}

    for _ in range(100):
        if server.call(lambda e: not e.has_unfinished() and not orphans(e)):
            break
        time.sleep(0.05)
    assert server.call(orphans) == set()
    # Plain requests get implicit sessions, which keep what they computed; closing them frees it all.
    server.call(lambda e: [e.close_session(s.session_id) for s in list(e.sessions)
                           if s.session_id.split("/", 1)[1].startswith("~")])
    assert _free_blocks(server) >= baseline


def test_tenant_isolation(server: LiveServer) -> None:
    alice, bob = client(server, "key-alice"), client(server, "key-bob")
    alice.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "secret"}], max_tokens=2,
                                  extra_headers={"X-Session-ID": "shared-name"})
    auth_bob = {"Authorization": "Bearer key-bob"}
    assert httpx.get(server.url + "/v1/sessions/shared-name", headers=auth_bob).status_code == 404
    assert httpx.delete(server.url + "/v1/sessions/shared-name", headers=auth_bob).status_code == 404
    # Same long prompt: alice's second call hits her prefix cache, bob's first call cannot.
    msgs = [{"role": "user", "content": "the same long prompt " * 30}]
    alice.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    again = alice.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    other = bob.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_metrics_move_with_traffic(server: LiveServer) -> None:
    def requests_total() -> float:
        text = httpx.get(server.url + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("sessionserve_requests_total"))

    before = requests_total()
    client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert requests_total() == before + 1
    text = httpx.get(server.url + "/metrics").text
    assert "sessionserve_time_to_first_token_seconds_bucket" in text and "sessionserve_kv_blocks" in text
    assert 'sessionserve_num_preemptions{cause="memory",model="tiny"} 0.0' in text
    # CPU roles: the chat was rendered on the tokenize pool and stepped by the engine thread.
    seconds = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sessionserve_cpu_role_seconds{")}
    assert seconds['kind="busy",role="engine"'] > 0 and seconds['kind="busy",role="tokenize"'] > 0
    assert 0 < seconds['kind="cpu",role="engine"'] <= seconds['kind="busy",role="engine"'] * 1.05
    assert 'sessionserve_cpu_role_busy_fraction{role="tokenize"}' in text


def test_trace_of_one_session_step() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from sessionserve.obs.tracing import Tracer

    exporter = InMemorySpanExporter()
    tracer = Tracer(span_exporter=exporter)
    tracer.record_request(name="chat.completion", request_id="r1", wall_offset_s=1000.0, arrival_s=1.0,
                          scheduled_s=1.2, first_token_s=1.5, finished_s=2.0, restore_blocked_s=0.1,
                          attributes={"sessionserve.session_id": "s1", "sessionserve.session_step": 3})
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"chat.completion", "queue", "restore", "prefill", "decode"}
    root = spans["chat.completion"]
    assert root.attributes["sessionserve.session_step"] == 3
    assert all(s.parent.span_id == root.context.span_id for n, s in spans.items() if n != "chat.completion")
    assert spans["decode"].end_time - spans["decode"].start_time == 500_000_000


def test_second_turn_while_one_runs_is_a_409(server: LiveServer) -> None:
    import threading

    auth = {"Authorization": "Bearer key-alice", "X-Session-ID": "busy-1"}
    long = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 300, "ignore_eos": True}
    first = threading.Thread(target=lambda: httpx.post(server.url + "/v1/chat/completions", json=long, headers=auth,
                                                       timeout=120))
    first.start()
    for _ in range(200):
        info = httpx.get(server.url + "/v1/sessions/busy-1", headers=auth)
        if info.status_code == 200 and info.json()["state"] == "running":
            break
        time.sleep(0.01)
    r = httpx.post(server.url + "/v1/chat/completions", json={**long, "max_tokens": 2}, headers=auth)
    first.join()
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy"


def test_completions_return_token_ids(server: LiveServer) -> None:
    auth = {"Authorization": "Bearer key-alice"}
    body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=auth).json()
    choice = r["choices"][0]
    assert choice["prompt_token_ids"] == [5, 6, 7, 8, 9] and len(choice["token_ids"]) == 6
    assert r["usage"]["completion_tokens"] == 6
    streamed: list[int] = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=auth) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                streamed += sum((c.get("token_ids") or [] for c in json.loads(line[6:])["choices"]), [])
    assert streamed == choice["token_ids"]
    plain = httpx.post(server.url + "/v1/completions", json={**body, "return_token_ids": False}, headers=auth).json()
    assert "token_ids" not in plain["choices"][0]


def test_tools_and_response_format_together(server: LiveServer) -> None:
    """Tools offered (tool_choice auto) and a response format: the reply is a valid tool call or JSON in the
    format, never neither (one grammar for both)."""
    schema = {"type": "object", "properties": {"verdict": {"type": "string", "enum": ["pass", "fail"]}},
              "required": ["verdict"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "run_tests", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "enum": ["a.py", "b.py"]}}, "required": ["path"]}}}]
    kinds = set()
    for seed in range(6):
        r = client(server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Check the tests ({seed})."}], tools=tools,
            response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}},
            max_tokens=80, temperature=1.0, seed=seed)
        msg = r.choices[0].message
        if msg.tool_calls:
            assert json.loads(msg.tool_calls[0].function.arguments)["path"] in ("a.py", "b.py")
            assert r.choices[0].finish_reason == "tool_calls"
            kinds.add("call")
        else:
            assert json.loads(msg.content)["verdict"] in ("pass", "fail")
            kinds.add("answer")
    assert kinds
