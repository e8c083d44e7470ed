"""OpenAI request validation, error bodies, and the mapping of requests to sampling parameters."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from sessionserve.server import protocol as P
from sessionserve.types.sampling_params import SamplingParams

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "noop"}}]


def chat(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return body


def test_minimal_and_full_agent_conversation() -> None:
    req = P.parse_chat_request(chat())
    assert req.model == "m" and req.stream is False and req.tool_names is None
    body = chat(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"P"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "assistant", "content": "Sunny.", "refusal": None},
        ],
        tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False, stream=True, stream_options={"include_usage": True},
        max_tokens=5, max_completion_tokens=7, temperature=0, top_p=0.5, seed=3, stop=["\n"], n=1,
        logprobs=True, top_logprobs=2, frequency_penalty=0.5, presence_penalty=-1, logit_bias={"42": -100},
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}},
        user="u", session_id="agent-1:turn.2", priority="batch", expected_wait_s=1.5, ignore_eos=True, min_tokens=2,
        metadata={"unknown": "fields are ignored"}, store=False,
    )
    req = P.parse_chat_request(body)
    assert req.max_output_tokens == 7  # max_completion_tokens wins
    assert req.include_usage and req.tool_names == {"get_weather", "noop"}
    assert req.forced_tool_name == "get_weather" and req.logit_bias == {42: -100.0}
    msgs = req.template_messages()
    assert msgs[0] == {"role": "system", "content": "Be brief."}
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"P"}'}
    assert msgs[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert P.parse_chat_request(body).template_tools()[1] == {"type": "function", "function": {"name": "noop"}}


def test_tool_call_arguments_given_as_object_become_json() -> None:
    msg = {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                "function": {"name": "f", "arguments": {"x": "ü"}}}]}
    req = P.parse_chat_request(chat(messages=[msg]))
    assert req.messages[0].tool_calls[0].function.arguments == '{"x": "ü"}'


@pytest.mark.parametrize("fields, param", [
    ({"model": None}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}]}, "messages.1.tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": TOOLS + [TOOLS[1]]}, "tools.2.function.name"),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"stream": 1}, "stream"),
    ({"stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": "5"}, "max_completion_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"seed": 1.5}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"n": 2}, "n"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}}, "response_format.json_schema.name"),
    ({"session_id": 7}, "session_id"),  # any string is taken (server/turn/identity.py maps it), not a number
    ({"priority": "urgent"}, "priority"),
    ({"expected_wait_s": -1}, "expected_wait_s"),
    ({"min_tokens": -1}, "min_tokens"),
])
def test_invalid_chat_requests_are_400_with_param(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(P.OpenAIError) as info:
        P.parse_chat_request(chat(**fields))
    err = info.value
    assert (err.status_code, err.param) == (400, param), err
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    assert body["message"] and "Value error" not in body["message"]


def test_error_messages_are_readable() -> None:
    def message(**fields: Any) -> str:
        with pytest.raises(P.OpenAIError) as info:
            P.parse_chat_request(chat(**fields))
        return info.value.message

    assert message(model=None) == "Invalid value for 'model': Input should be a valid string."
    missing = copy.deepcopy(chat())
    del missing["model"]
    with pytest.raises(P.OpenAIError) as info:
        P.parse_chat_request(missing)
    assert info.value.message == "Missing required parameter: 'model'."
    assert info.value.code == "missing_required_parameter"
    assert "not supported" in message(messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    assert "only n=1" in message(n=3)


def test_body_must_be_an_object_and_fastapi_errors_are_formatted() -> None:
    with pytest.raises(P.OpenAIError) as info:
        P.parse_chat_request([1, 2])
    assert info.value.status_code == 400
    # FastAPI's RequestValidationError.errors() put "body" first.
    err = P.format_validation_errors([{"loc": ("body", "messages", 0, "role"), "msg": "bad", "type": "literal_error"}])
    assert err.param == "messages.0.role" and err.code == "invalid_value"


def test_error_helpers() -> None:
    err = P.not_found("The model 'x' does not exist.", "model", "model_not_found")
    assert err.status_code == 404
    assert err.body() == {"error": {"message": "The model 'x' does not exist.", "type": "not_found_error",
                                    "param": "model", "code": "model_not_found"}}
    assert P.bad_request("no").body()["error"] == {"message": "no", "type": "invalid_request_error",
                                                   "param": None, "code": None}
    assert (P.unauthorized().status_code, P.rate_limited("busy").status_code, P.server_error().status_code) == \
        (401, 429, 500)
    assert P.valid_session_id("a.b:c-d_e") and not P.valid_session_id("") and not P.valid_session_id("a/b")


def test_sampling_kwargs_defaults_and_mapping() -> None:
    kw = P.sampling_kwargs(P.parse_chat_request(chat()), default_max_tokens=1000)
    assert kw["max_tokens"] == 1000 and kw["temperature"] == 1.0 and kw["top_p"] == 1.0 and kw["logprobs"] is None
    SamplingParams(**kw)
    req = P.parse_chat_request(chat(max_tokens=5, temperature=0, top_p=0.9, seed=7, stop="END", logprobs=True,
                                    top_logprobs=3, logit_bias={"11": 5}, ignore_eos=True, min_tokens=2, top_k=4,
                                    min_p=0.1, stop_token_ids=[2], speculate=False, presence_penalty=0.5,
                                    frequency_penalty=-0.25, repetition_penalty=1.2))
    kw = P.sampling_kwargs(req, default_max_tokens=1000)
    assert kw == {"max_tokens": 5, "temperature": 0.0, "top_p": 0.9, "top_k": 4, "min_p": 0.1, "seed": 7,
                  "stop": ("END",), "stop_token_ids": (2,), "ignore_eos": True, "min_tokens": 2, "logprobs": 3,
                  "logit_bias": {11: 5.0}, "presence_penalty": 0.5, "frequency_penalty": -0.25,
                  "repetition_penalty": 1.2, "speculate": False}
    assert SamplingParams(**kw).is_greedy
    # logprobs without top_logprobs: the sampled token's only.
    assert P.sampling_kwargs(P.parse_chat_request(chat(logprobs=True)), 10)["logprobs"] == 0
    with pytest.raises(P.OpenAIError) as info:
        P.sampling_kwargs(P.parse_chat_request(chat(max_tokens=2, min_tokens=3)), 10)
    assert info.value.param == "min_tokens"


def test_completion_requests() -> None:
    req = P.parse_completion_request({"model": "m", "prompt": "Once"})
    kw = P.sampling_kwargs(req, default_max_tokens=1000)
    assert req.prompt == "Once" and kw["max_tokens"] == 16  # OpenAI's completion default
    assert P.parse_completion_request({"model": "m", "prompt": ["Once"]}).prompt == "Once"
    assert P.parse_completion_request({"model": "m", "prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert P.parse_completion_request({"model": "m", "prompt": [[1, 2]]}).prompt == [1, 2]
    req = P.parse_completion_request({"model": "m", "prompt": "x", "max_tokens": None, "logprobs": 2, "stream": True,
                                      "stream_options": {"include_usage": True}, "session_id": "s1", "echo": False})
    kw = P.sampling_kwargs(req, default_max_tokens=100)
    assert (kw["max_tokens"], kw["logprobs"], req.include_usage) == (100, 2, True)
    SamplingParams(**kw)


@pytest.mark.parametrize("fields, param", [
    ({"prompt": None}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"logprobs": 6}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"n": 2}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"suffix": "end"}, "suffix"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ["a"] * 5}, "stop"),
])
def test_invalid_completion_requests(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(P.OpenAIError) as info:
        P.parse_completion_request({"model": "m", "prompt": "x", **fields})
    assert (info.value.status_code, info.value.param) == (400, param)


def test_guided_decoding() -> None:
    assert P.guided_decoding(P.parse_chat_request(chat())) is None
    g = P.guided_decoding(P.parse_chat_request(chat(tools=TOOLS, tool_choice="required")))
    assert g is not None and g.kind == "tool_calls" and g.spec_value()["mode"] == "required"
    g = P.guided_decoding(P.parse_chat_request(chat(tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "noop"}}, parallel_tool_calls=False)))
    assert g is not None and g.spec_value()["name"] == "noop" and g.spec_value()["parallel"] is False
    g = P.guided_decoding(P.parse_chat_request(chat(response_format={"type": "json_object"})))
    assert g is not None and g.kind == "json_object"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    g = P.guided_decoding(P.parse_chat_request(chat(response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})))
    assert g is not None and g.kind == "json_schema" and g.spec_value() == schema
    # With tools the model may call, a JSON grammar would forbid the calls: no constraint.
    assert P.guided_decoding(P.parse_chat_request(chat(tools=TOOLS, response_format={"type": "json_object"}))) is None
