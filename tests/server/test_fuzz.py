"""Property-based fuzzing of the HTTP API: every answer is a 200 or a well-formed 4xx, never a 5xx.

Bodies are drawn from JSON of any shape and type around the real request
schema (wrong types, huge and negative numbers, NaN, unicode, unknown fields,
invalid tool schemas), plus raw bytes. After the run the server still serves,
no request is left in the engine and the KV pool is consistent.
"""

from __future__ import annotations

import functools
import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.adversarial import ODD_SESSION_IDS
from tests.reliability.fuzz_bodies import long_text
from tests.server.conftest import LiveServer

AUTH = {"Authorization": "Bearer key-alice"}
OK_STATUSES = {200, 400, 401, 404, 409, 413, 429}

# Past int64 either way (seeds, caps and token ids that overflow a C long), without the valid caps in between
# (a valid cap of thousands of tokens would only make the run slow).
past_int64 = st.integers(2**63, 2**70) | st.integers(-(2**70), -(2**63) - 1)
token_id = st.integers(-(2**70), 2**70) | st.integers(16_000, 17_000) | past_int64  # the vocabulary is 16,384
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | past_int64
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40))
# Nesting hundreds deep (json.dumps goes to about 900 in a hypothesis test; adversarial.py goes past that).
deep = st.integers(1, 400).map(lambda d: functools.reduce(lambda acc, _: [acc], range(d), 0))
any_json = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                        max_leaves=8) | deep
text = (st.text(max_size=300) | st.sampled_from(["", "\x00", "\ud7ff\ue000", "<tool_call>{", "😀" * 50, "a" * 5000])
        | long_text(4096, 65_536) | st.sampled_from(ODD_SESSION_IDS))

schema = st.fixed_dictionaries({"type": st.sampled_from(["object", "string", "integer", "bogus"]) | any_json},
                               optional={"properties": st.dictionaries(st.text(max_size=6), any_json, max_size=3),
                                         "required": any_json, "maxLength": any_json, "enum": any_json})
tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "other"]) | any_json,
                              "function": st.fixed_dictionaries(
                                  {"name": st.text(max_size=70) | any_json},
                                  optional={"description": text, "parameters": schema | any_json})}) | any_json
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"]) | any_json,
     "content": text | any_json},
    optional={"tool_calls": st.lists(any_json, max_size=2) | any_json, "tool_call_id": text | any_json,
              "name": text})
chat_body = st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny", "nope"]) | any_json,
     "messages": st.lists(message, max_size=4) | any_json,
     "max_tokens": st.integers(0, 3) | st.sampled_from([-1, 10**9, 2**63]) | past_int64 | any_json},
    optional={"temperature": st.floats(allow_nan=True, allow_infinity=True) | any_json,
              "top_p": st.floats(allow_nan=True, allow_infinity=True) | any_json,
              "n": st.integers(-1, 3) | past_int64, "seed": st.integers(-(2**70), 2**70) | past_int64,
              "top_k": past_int64 | any_json, "min_tokens": past_int64 | any_json,
              "stop_token_ids": st.lists(token_id, max_size=4) | any_json,
              "stop": st.lists(text, max_size=5) | text | any_json, "stream": st.booleans() | any_json,
              "tools": st.lists(tool, max_size=3) | any_json,
              "tool_choice": st.sampled_from(["auto", "none", "required"]) | any_json,
              "response_format": st.fixed_dictionaries({"type": st.sampled_from(["json_object", "json_schema",
                                                                                 "text", "xml"])},
                                                       optional={"json_schema": any_json}) | any_json,
              "logprobs": st.booleans() | any_json, "top_logprobs": st.integers(-2, 50) | past_int64,
              "logit_bias": st.dictionaries(st.text(max_size=6) | token_id.map(str), any_json, max_size=3) | any_json,
              "priority": st.sampled_from(["interactive", "batch", "urgent"]) | any_json,
              "session_id": text | any_json, "expected_wait_s": any_json, "frobnicate": any_json})
# Valid requests with edge values (these get past validation and run), and valid ones with one field broken.
valid_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": text})
bounded_tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({
    "name": st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
    "parameters": st.just({"type": "object", "properties": {"q": {"type": "string", "maxLength": 8}},
                           "required": ["q"]})})})
valid_chat = st.fixed_dictionaries(
    {"model": st.just("tiny"),
     "messages": st.lists(valid_message, min_size=1, max_size=3).map(lambda m: [*m, {"role": "user", "content": "x"}]),
     "max_tokens": st.integers(1, 3)},
    optional={"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "seed": st.integers(0, 2**63 - 1),
              "stop": st.lists(text.filter(bool), max_size=4), "stream": st.booleans(),
              "tools": st.lists(bounded_tool, min_size=1, max_size=2, unique_by=lambda t: t["function"]["name"]),
              "tool_choice": st.sampled_from(["auto", "none", "required"]),
              "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}]),
              "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
              "logit_bias": st.dictionaries(st.integers(0, 300).map(str), st.floats(-100, 100), max_size=3),
              "priority": st.sampled_from(["interactive", "batch"]),
              "session_id": st.from_regex(r"[a-z0-9]{1,8}", fullmatch=True),
              "expected_wait_s": st.floats(0, 1e6), "stream_options": st.just({"include_usage": True})})


@st.composite
def broken_one_field(draw: st.DrawFn) -> dict:
    body = dict(draw(valid_chat))
    key = draw(st.sampled_from(sorted(body) + ["n", "max_completion_tokens", "user", "tools"]))
    if draw(st.booleans()) and key in body:
        del body[key]
    else:
        body[key] = draw(any_json | past_int64 | token_id.map(lambda t: {str(t): 5}) | st.lists(token_id, max_size=3))
    return body


completion_body = st.fixed_dictionaries(
    {"model": st.just("tiny") | any_json,
     "prompt": text | st.lists(st.integers(-5, 70000) | token_id, max_size=20) | any_json,
     "max_tokens": st.integers(0, 3) | any_json},
    optional={"echo": any_json, "stream": st.booleans(), "temperature": any_json, "logprobs": any_json,
              "suffix": any_json, "best_of": any_json, "seed": past_int64 | any_json,
              "logit_bias": st.dictionaries(token_id.map(str), st.floats(-100, 100), max_size=3) | any_json})


def _check(r: httpx.Response) -> None:
    assert r.status_code in OK_STATUSES, (r.status_code, r.text[:300])
    if r.status_code == 200:
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
            assert lines and lines[-1] == "data: [DONE]"
            for ln in lines[:-1]:
                json.loads(ln[len("data: "):])
        else:
            r.json()
        return
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)


def _post(server: LiveServer, path: str, body: object) -> httpx.Response:
    try:
        content = json.dumps(body, allow_nan=True)
    except (TypeError, ValueError):
        content = str(body)
    # A body without max_tokens may generate up to the whole cache (4k tokens): minutes on a slow CPU.
    return httpx.post(server.url + path, content=content.encode("utf-8", "surrogatepass"), timeout=300,
                      headers={**AUTH, "Content-Type": "application/json"})


FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(body=st.one_of(valid_chat, broken_one_field(), chat_body))
def test_chat_completions_never_5xx(server: LiveServer, body: dict) -> None:
    _check(_post(server, "/v1/chat/completions", body))


@FUZZ
@given(body=completion_body)
def test_completions_never_5xx(server: LiveServer, body: dict) -> None:
    _check(_post(server, "/v1/completions", body))


# Bodies past what JSON parsers take by default: nesting 100,000 deep, a 5,000-digit number, NaN, a MiB of NULs.
unbounded_raw = st.sampled_from([b"[" * 100_000, b'{"a":' * 5_000, b'{"model": 1' + b"0" * 5000 + b"}",
                                 b"\x00" * (1 << 20), b'{"seed": NaN}', b"\xff" * 300])


@settings(max_examples=40, deadline=None, derandomize=True)
@given(raw=st.binary(max_size=300) | unbounded_raw,
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/sessions", "/v1/sessions/x/fork"]))
def test_raw_bytes_never_5xx(server: LiveServer, raw: bytes, path: str) -> None:
    r = httpx.post(server.url + path, content=raw, headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code in OK_STATUSES, r.text[:200]
    if r.status_code != 200:
        assert r.json()["error"]["type"]


def test_server_is_healthy_and_clean_after_fuzzing(server: LiveServer) -> None:
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    unfinished, integrity = server.call(lambda e: (e.core.scheduler.num_unfinished, e.kv.check_integrity()))
    assert unfinished == 0 and integrity is None


def test_requests_in_flight_per_key_are_limited(tiny_llama) -> None:  # noqa: ANN001 - path fixture
    import concurrent.futures

    from sessionserve import LLMEngine
    from sessionserve.config import Config
    from sessionserve.server.app import create_app
    from sessionserve.server.auth import Auth
    from tests.server.conftest import KEYS, run_app

    engine = LLMEngine(Config.from_kwargs(num_blocks=128, max_num_seqs=2, host_kv_bytes=0), tiny_llama)
    app = create_app(engine, model_name="tiny", auth=Auth(KEYS), max_requests_per_tenant=2)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 200, "ignore_eos": True}
    try:
        with run_app(app) as url, concurrent.futures.ThreadPoolExecutor(6) as pool:
            def post(key: str) -> int:
                return httpx.post(url + "/v1/chat/completions", json=body, timeout=120,
                                  headers={"Authorization": f"Bearer {key}"}).status_code
            alice = list(pool.map(post, ["key-alice"] * 5))
            assert alice.count(429) >= 1 and alice.count(200) >= 2, alice
            assert post("key-bob") == 200  # another key is not limited by alice's load
            assert post("key-alice") == 200  # and alice's slots came back
            assert app.state.ss.in_flight == {}
    finally:
        engine.close()
