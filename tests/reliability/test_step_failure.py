"""An exception inside an engine step: the request it hit gets an error, the others run on, the server lives.

The sampler is made to raise for one request id (the client's X-Request-ID
is part of the engine request id). That request is answered with OpenAI error
JSON (a streamed one ends with an error event and [DONE]); the requests that
shared its step finish with the output they get without it; nothing leaks; a
session whose turn failed takes its next turn with the same output as a
session that never failed.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import httpx
import pytest

from sessionserve.types.sequence import Sequence
from tests.reliability.conftest import (
    ALICE,
    assert_all_free,
    chat,
    close_all_sessions,
    live_server,
    sse_events,
    wait_idle,
)
from tests.server.conftest import LiveServer

POISON = "poison"  # request ids starting with this make the sampler raise


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    with live_server(tiny_llama, tmp_path_factory.mktemp("spool")) as s:
        runner = s.engine.runner
        real = runner._sample_row

        def sample_row(seq: Sequence):
            if POISON in seq.request_id:
                raise RuntimeError("injected sampler failure")
            return real(seq)

        runner._sample_row = sample_row  # read by the engine thread at each step
        yield s


def _errors(server: LiveServer) -> int:
    return server.call(lambda e: e.core.num_failed_steps)


def test_failed_request_gets_an_error_and_the_next_is_served(server: LiveServer) -> None:
    before = _errors(server)
    msgs = [{"role": "user", "content": "hello"}]
    r = chat(server, msgs, headers={"X-Request-ID": f"{POISON}1"}, max_tokens=8)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
    assert _errors(server) == before + 1
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers={**ALICE, "X-Request-ID": f"{POISON}2"},
                      json={"model": "tiny", "messages": msgs, "max_tokens": 8, "stream": True}, timeout=60) as s:
        lines = [ln for ln in s.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and sse_events(lines)[-1]["error"]["type"] == "server_error", lines
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    ok = chat(server, msgs, max_tokens=8, ignore_eos=True)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8, ok.text
    wait_idle(server, timeout_s=10)
    assert not server.app.state.ss.in_flight


def test_requests_sharing_the_failed_step_run_on_with_their_own_output(server: LiveServer) -> None:
    body = {"max_tokens": 60, "ignore_eos": True}
    prompts = [[{"role": "user", "content": f"bystander {i}"}] for i in range(4)]
    quiet = [chat(server, p, **body).json()["choices"][0]["message"]["content"] for p in prompts]
    before = _errors(server)
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        others = [pool.submit(chat, server, p, **body) for p in prompts]
        poisoned = pool.submit(chat, server, [{"role": "user", "content": "x"}],
                               headers={"X-Request-ID": f"{POISON}3"}, **body)
        assert poisoned.result().status_code == 500
        results = [f.result() for f in others]
    assert _errors(server) > before  # it did share steps with them
    assert [r.json()["choices"][0]["message"]["content"] for r in results] == quiet
    assert chat(server, [{"role": "user", "content": "after"}], max_tokens=4).status_code == 200
    wait_idle(server, timeout_s=10)


def test_session_turn_that_failed_can_be_retried(server: LiveServer) -> None:
    msgs = [{"role": "user", "content": "plan the refactor"}]
    outs = {}
    for sid in ("fails-once", "never-fails"):
        first = chat(server, msgs, session_id=sid, max_tokens=6, ignore_eos=True).json()
        msgs2 = msgs + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                        {"role": "user", "content": "now run the tests"}]
        if sid == "fails-once":
            r = chat(server, msgs2, session_id=sid, headers={"X-Request-ID": f"{POISON}4"}, max_tokens=6)
            assert r.status_code == 500
        r = chat(server, msgs2, session_id=sid, max_tokens=6, ignore_eos=True)
        assert r.status_code == 200, r.text
        outs[sid] = r.json()["choices"][0]["message"]["content"]
    assert outs["fails-once"] == outs["never-fails"]
    wait_idle(server)
    close_all_sessions(server)
    assert_all_free(server)
