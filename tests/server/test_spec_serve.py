"""A server with speculative decoding: same answers as without, drafting visible in /metrics, opt-out per request."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from sessionserve import LLMEngine
from sessionserve.config import Config
from sessionserve.server.app import create_app
from sessionserve.server.auth import Auth
from tests.server.conftest import KEYS, run_app

AUTH = {"Authorization": "Bearer key-alice"}
MESSAGES = [{"role": "user", "content": "import os\nimport sys\nimport os\nimport sys\nimport os\n" * 3}]


def _spec_counter(url: str, what: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(rf'sessionserve_spec_decode_tokens{{model="[^"]+",what="{what}"}} ([0-9.e+]+)', text)
    assert m is not None, text[:500]
    return float(m.group(1))


def _chat(url: str, **extra) -> str:
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 24, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_speculative_server_answers_as_the_plain_one(tiny_llama: Path) -> None:
    answers = {}
    for method in ("none", "ngram"):
        engine = LLMEngine(Config.from_kwargs(num_blocks=128, speculative_method=method), tiny_llama)
        with run_app(create_app(engine, auth=Auth(KEYS))) as url:
            answers[method] = _chat(url)
            streamed = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
                "model": "default", "messages": MESSAGES, "max_tokens": 24, "temperature": 0, "stream": True})
            assert streamed.status_code == 200 and "[DONE]" in streamed.text
            if method == "ngram":
                proposed = _spec_counter(url, "proposed")
                assert proposed > 0 and _spec_counter(url, "accepted") <= proposed
                assert _chat(url, speculate=False) == answers["none"]  # opted out: no drafts
                assert _spec_counter(url, "proposed") == proposed
                r = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
                    "model": "default", "messages": MESSAGES, "speculate": "maybe"})
                assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert answers["ngram"] == answers["none"]
