"""Log-probabilities in every mode OpenAI offers them, over HTTP: finite values, one entry per token."""

from __future__ import annotations

import json
import math

import httpx
import openai

from tests.server.conftest import LiveServer

AUTH = {"Authorization": "Bearer key-alice"}


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="key-alice", max_retries=0)


def finite(values: list[float]) -> bool:
    return all(isinstance(v, float | int) and math.isfinite(v) for v in values)


def test_chat_logprobs_non_streamed_and_streamed(server: LiveServer) -> None:
    msgs = [{"role": "user", "content": "Name a colour."}]
    # A bias of -100 makes a token's probability 0 (log -inf); it must come back finite.
    kw = dict(model="tiny", messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
              logit_bias={"7": -100}, extra_body={"ignore_eos": True})
    full = client(server).chat.completions.create(**kw)
    entries = full.choices[0].logprobs.content
    assert len(entries) == full.usage.completion_tokens == 6
    assert all(len(e.top_logprobs) >= 3 and finite([e.logprob] + [t.logprob for t in e.top_logprobs]) for e in entries)
    streamed = [e for chunk in client(server).chat.completions.create(**kw, stream=True)
                for c in chunk.choices if c.logprobs and c.logprobs.content for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [round(e.logprob, 4) for e in streamed] == [round(e.logprob, 4) for e in entries]


def test_completion_logprobs_non_streamed_and_streamed(server: LiveServer) -> None:
    body = {"model": "tiny", "prompt": "def main():", "max_tokens": 5, "temperature": 0, "logprobs": 2,
            "ignore_eos": True}
    full = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH).json()
    lp = full["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 5 and finite(lp["token_logprobs"])
    assert all(len(top) >= 2 and finite(list(top.values())) for top in lp["top_logprobs"])
    assert "".join(lp["tokens"]) == full["choices"][0]["text"]
    tokens: list[str] = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    if choice["logprobs"]:
                        tokens += choice["logprobs"]["tokens"]
                        assert finite(choice["logprobs"]["token_logprobs"])
    assert tokens == lp["tokens"]


def test_responses_logprobs(server: LiveServer) -> None:
    r = httpx.post(server.url + "/v1/responses", headers=AUTH, json={
        "model": "tiny", "input": "Name a colour.", "max_output_tokens": 16, "temperature": 0, "top_logprobs": 2,
        "include": ["message.output_text.logprobs"]}).json()
    part = r["output"][0]["content"][0]
    assert len(part["logprobs"]) == r["usage"]["output_tokens"]
    assert all(finite([e["logprob"]] + [t["logprob"] for t in e["top_logprobs"]]) for e in part["logprobs"])


def test_gauges_are_current_when_the_engine_is_idle(server: LiveServer) -> None:
    import time

    c = client(server)
    c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x " * 200}], max_tokens=2,
                              extra_headers={"X-Session-ID": "gauge-1"})
    assert httpx.delete(server.url + "/v1/sessions/gauge-1", headers=AUTH).status_code == 200
    server.call(lambda e: [e.close_session(s.session_id) for s in list(e.sessions)])
    time.sleep(1.5)  # no request, no step: only the idle sampling can update the gauges

    def gauge(name: str) -> float:
        text = httpx.get(server.url + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    assert gauge('sessionserve_kv_blocks') == 0 and gauge("sessionserve_sessions") == 0
