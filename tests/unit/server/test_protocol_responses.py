"""Response bodies match OpenAI's: parsed by the official `openai` client's types, and end to end
through the client itself over a mock transport (requests it sends validate in our models)."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from sessionserve.server import protocol as P
from sessionserve.server.api.chat_completions import tool_call_dict
from sessionserve.server.turn.tool_calls import Event, parse_output, tool_call_stream
from sessionserve.server.turn.types import TextDelta, ToolCallDelta, ToolCallStart
from sessionserve.types.guided import ToolFormat

USAGE = P.usage_dict(prompt_tokens=10, completion_tokens=4, cached_tokens=8)
LOGPROBS = [P.TokenLogprob("Hi", -0.1, top=(P.TokenLogprob("Hi", -0.1), P.TokenLogprob("Yo", float("-inf")))),
            P.TokenLogprob("\ufffd", -1.0, token_bytes=b"\xe6")]
MODEL_OUTPUT = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def parse_tool_calls(text: str, names: set[str] | None) -> tuple[str | None, list[dict[str, Any]]]:
    """The content and tool calls a chat completion carries for a finished output (as the route builds them)."""
    content, calls, _ = parse_output(text, names, ToolFormat.HERMES)
    return content, [tool_call_dict(c) for c in calls]


def chunk_delta(event: Event) -> dict[str, Any] | None:
    """The chat chunk delta of a parser event, as the streaming route sends it."""
    if isinstance(event, TextDelta):
        return {"content": event.text}
    if isinstance(event, ToolCallStart):
        return {"tool_calls": [{"index": event.index, "id": event.call_id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    if isinstance(event, ToolCallDelta):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]}
    return None


def test_chat_completion_with_tool_calls_and_logprobs() -> None:
    content, calls = parse_tool_calls(MODEL_OUTPUT, {"get_weather"})
    body = P.chat_completion("chatcmpl-1", 1700000000, "m", content, calls,
                             "tool_calls" if calls else "stop", USAGE, logprobs=LOGPROBS)
    parsed = ChatCompletion.model_validate(body)
    assert parsed.object == "chat.completion" and parsed.choices[0].finish_reason == "tool_calls"
    msg = parsed.choices[0].message
    assert msg.role == "assistant" and msg.content == "Checking." and msg.refusal is None
    assert msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Zürich"}
    lp = parsed.choices[0].logprobs.content
    assert lp[0].top_logprobs[1].logprob == P.LOGPROB_FLOOR and lp[1].bytes == [0xE6]
    assert parsed.usage.total_tokens == 14 and parsed.usage.prompt_tokens_details.cached_tokens == 8
    json.dumps(body, allow_nan=False)  # -inf was floored: valid JSON


def test_chat_completion_plain_text_has_no_tool_calls_key() -> None:
    body = P.chat_completion("c", 1, "m", "Hello", [], "length", USAGE)
    assert "tool_calls" not in body["choices"][0]["message"] and body["choices"][0]["logprobs"] is None
    assert ChatCompletion.model_validate(body).choices[0].finish_reason == "length"


def stream_chunks(text_pieces: list[str], include_usage: bool) -> list[dict[str, Any]]:
    """The chunks a route sends for a streamed chat reply with tools."""
    parser = tool_call_stream(ToolFormat.HERMES, {"get_weather"})
    chunks = [P.chat_chunk("c", 1, "m", {"role": "assistant", "content": ""})]
    events = [e for piece in text_pieces for e in parser.feed(piece)] + parser.finish()
    chunks += [P.chat_chunk("c", 1, "m", delta) for delta in map(chunk_delta, events) if delta is not None]
    chunks.append(P.chat_chunk("c", 1, "m", {}, finish_reason="tool_calls" if parser.calls else "stop"))
    if include_usage:
        chunks.append(P.chat_chunk("c", 1, "m", None, usage=USAGE))
    return chunks


def test_chat_chunks_parse_as_openai_chunks() -> None:
    chunks = [ChatCompletionChunk.model_validate(c) for c in stream_chunks(list(MODEL_OUTPUT), include_usage=True)]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == "Checking."
    deltas = [tc for c in chunks[:-1] for tc in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Zürich"}
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    ChatCompletionChunk.model_validate(P.chat_chunk("c", 1, "m", {"content": "x"}, logprobs=LOGPROBS))


def test_completion_bodies() -> None:
    parsed = Completion.model_validate(P.completion("cmpl-1", 1, "m", " upon a time", "length", USAGE,
                                                   logprobs=LOGPROBS))
    assert parsed.object == "text_completion" and parsed.choices[0].text == " upon a time"
    assert parsed.choices[0].logprobs.tokens == ["Hi", "\ufffd"] and parsed.choices[0].logprobs.text_offset == [0, 2]
    assert parsed.choices[0].logprobs.top_logprobs[0] == {"Hi": -0.1, "Yo": P.LOGPROB_FLOOR}
    # OpenAI streams finish_reason null until the last chunk, though the client's type says non-null.
    body = P.completion_chunk("cmpl-1", 1, "m", " upon")
    assert body["choices"][0]["finish_reason"] is None
    body["choices"][0]["finish_reason"] = "stop"
    assert Completion.model_validate(body).choices[0].text == " upon"
    last = P.completion_chunk("cmpl-1", 1, "m", "", "stop")
    assert Completion.model_validate(last).choices[0].finish_reason == "stop"
    usage_only = P.completion_chunk("cmpl-1", 1, "m", None, None, usage=USAGE)
    assert usage_only["choices"] == [] and Completion.model_validate(usage_only).usage.total_tokens == 14


def test_model_card() -> None:
    assert Model.model_validate(P.model_card("qwen-tiny", created=5)).id == "qwen-tiny"


# --- end to end through the official client ---

def fake_server(model_output: str, status_error: P.OpenAIError | None = None) -> httpx2.MockTransport:
    """A stand-in for the routes: validates the client's request with our models, answers with our builders."""

    def handle(request: httpx2.Request) -> httpx2.Response:
        if request.url.path.endswith("/models"):
            return httpx2.Response(200, json={"object": "list", "data": [P.model_card("m", 1)]})
        try:
            if status_error is not None:
                raise status_error
            req = P.parse_chat_request(json.loads(request.content))
        except P.OpenAIError as exc:
            return httpx2.Response(exc.status_code, json=exc.body())
        if not req.stream:
            content, calls = parse_tool_calls(model_output, req.tool_names)
            return httpx2.Response(200, json=P.chat_completion(
                "c", 1, req.model, content, calls, "tool_calls" if calls else "stop", USAGE))
        chunks = stream_chunks([model_output[i:i + 3] for i in range(0, len(model_output), 3)], req.include_usage)
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx2.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    return httpx2.MockTransport(handle)


def client(transport: httpx2.MockTransport) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://test/v1", api_key="k", max_retries=0,
                         http_client=httpx2.Client(transport=transport), _strict_response_validation=True)


def test_openai_client_round_trip() -> None:
    c = client(fake_server(MODEL_OUTPUT))
    messages: list[Any] = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather?"}]
    reply = c.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="auto",
                                      max_completion_tokens=50, temperature=0.2, seed=1,
                                      extra_body={"session_id": "s-1", "expected_wait_s": 2.0})
    call = reply.choices[0].message.tool_calls[0]
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    # The agent's next turn: the assistant message as the client dumps it, then the tool result.
    messages += [reply.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    stream = c.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 10
    names = [tc.function.name for ch in chunks for d in ch.choices for tc in d.delta.tool_calls or []
             if tc.function and tc.function.name]
    assert names == ["get_weather"]
    assert [m.id for m in c.models.list()] == ["m"]


def test_openai_client_sees_our_errors() -> None:
    c = client(fake_server(""))
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], n=2)
    assert info.value.param == "n" and info.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as nf:
        client(fake_server("", P.not_found("no such model", "model", "model_not_found"))).chat.completions.create(
            model="x", messages=[{"role": "user", "content": "x"}])
    assert nf.value.code == "model_not_found"
