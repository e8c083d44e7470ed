"""POST /v1/responses with the official `openai` client, checked against the Open Responses schema."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import LiveServer
from tests.server.open_responses import event_problems, parse_sse, response_problems

# Bounded arguments, so the tiny random model finishes a forced call in a few tokens.
TOOLS = [{"type": "function", "name": "run", "description": "Run a shell command",
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string", "enum": ["ls", "pwd", "make"]}},
                         "required": ["cmd"]}},
         {"type": "web_search"}]  # a tool this server does not run: accepted, not offered


def client(server: LiveServer, key: str = "key-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def raw(server: LiveServer, body: dict, key: str = "key-alice") -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=120)


def stream_events(server: LiveServer, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True},
                      headers={"Authorization": "Bearer key-alice"}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        pairs = parse_sse([line for line in r.iter_lines()])
    assert pairs[-1] == (None, "[DONE]")
    events = [data for _, data in pairs[:-1]]
    for name, data in pairs[:-1]:
        assert name == data["type"]  # the `event:` line names the event
        assert event_problems(data) == [], (data["type"], event_problems(data))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_plain_response_validates(server: LiveServer) -> None:
    r = raw(server, {"model": "tiny", "input": "Say hello.", "max_output_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert response_problems(body) == []
    assert body["status"] in ("completed", "incomplete") and body["output"][0]["type"] == "message"
    assert body["usage"]["input_tokens_details"]["cached_tokens"] >= 0
    sdk = client(server).responses.create(model="tiny", input="Say hello.", max_output_tokens=16, temperature=0)
    assert sdk.output_text == body["output"][0]["content"][0]["text"]  # greedy: the same answer


def test_streamed_events_validate_and_match_the_final_object(server: LiveServer) -> None:
    body = {"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Count."}]}],
            "instructions": "Be brief.", "max_output_tokens": 20, "temperature": 0}
    events = stream_events(server, body)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          events[-1]["type"]] and events[-1]["type"] in ("response.completed", "response.incomplete")
    final = events[-1]["response"]
    assert response_problems(final) == []
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert final["output"][0]["content"][0]["text"] == text
    sdk = client(server).responses.create(**body)
    assert sdk.output_text == text


def _call_turn(c: openai.OpenAI, **kw: object) -> openai.types.responses.Response:
    """A turn that must call a tool; its raw body is checked against the schema."""
    raw = c.responses.with_raw_response.create(model="tiny", tools=TOOLS, tool_choice="required",
                                               max_output_tokens=200, temperature=0, **kw)
    assert response_problems(raw.http_response.json()) == []
    return raw.parse()


def test_function_tool_round_trip_with_previous_response_id(server: LiveServer) -> None:
    c = client(server)
    first = _call_turn(c, input="List the files.")
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and calls and calls[0].name == "run"
    assert json.loads(calls[0].arguments)["cmd"] in ("ls", "pwd", "make")
    second = _call_turn(c, previous_response_id=first.id,
                        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "a.py b.py"}])
    # Continued on the session: everything the first turn held (its prompt and the model's own reply) was
    # cached; only the tool output and the next assistant header were computed (and the reply's last token).
    assert second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens - second.usage.input_tokens_details.cached_tokens < 40
    assert second.previous_response_id == first.id
    # GET returns the stored object; another tenant cannot see it; DELETE removes it.
    got = c.responses.retrieve(second.id)
    assert got.id == second.id and got.output[0].type == second.output[0].type
    with pytest.raises(openai.NotFoundError):
        client(server, "key-bob").responses.retrieve(second.id)
    c.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(second.id)


def test_streamed_function_call_arguments(server: LiveServer) -> None:
    events = stream_events(server, {"model": "tiny", "input": "Build it.", "tools": TOOLS, "tool_choice": "required",
                                    "max_output_tokens": 200, "temperature": 0})
    deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert len(deltas) > 1 and done  # the arguments stream as they are generated
    assert "".join(d["delta"] for d in deltas if d["item_id"] == done[0]["item_id"]) == done[0]["arguments"]
    assert events[-1]["response"]["output"][0]["arguments"] == done[0]["arguments"]


def test_text_format_json_schema(server: LiveServer) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    r = raw(server, {"model": "tiny", "input": "Is it done?", "max_output_tokens": 64, "temperature": 0,
                     "text": {"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}}})
    assert response_problems(r.json()) == []
    assert json.loads(r.json()["output"][0]["content"][0]["text"])["answer"] in ("yes", "no")


def test_store_false_with_full_history_computes_only_new_items(server: LiveServer) -> None:
    c = client(server)
    key = {"prompt_cache_key": "codex-thread-1", "store": False}
    history: list = [{"type": "message", "role": "developer", "content": "You are a coding agent."},
                     {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix it."}]}]
    first = _call_turn(c, input=history, **key)
    with pytest.raises(openai.NotFoundError):  # store: false keeps nothing
        c.responses.retrieve(first.id)
    call = next(o for o in first.output if o.type == "function_call")
    # The client echoes the call (as Codex does, with its own key order and spacing) and adds the output.
    args = json.dumps(json.loads(call.arguments), indent=1, sort_keys=True)
    history += [{"type": "function_call", "id": call.id, "call_id": call.call_id, "name": call.name,
                 "arguments": args, "status": "completed"},
                {"type": "function_call_output", "call_id": call.call_id, "output": "done"}]
    second = _call_turn(c, input=history, **key)
    assert second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens + first.usage.output_tokens - 1


def test_bad_requests(server: LiveServer) -> None:
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="not supported"):
        c.responses.create(model="tiny", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="tiny", input="hi", previous_response_id="resp_nope")
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="nope", input="hi")
    r = raw(server, {"model": "tiny", "input": "hi", "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = raw(server, {"model": "tiny", "input": [{"type": "function_call", "name": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.call_id"
    r = httpx.post(server.url + "/v1/responses/compact", json={"model": "tiny", "input": "hi"},
                   headers={"Authorization": "Bearer key-alice"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_endpoint"
