"""The HTTP backend against a live sessionserve server (tiny model): with sessions and without."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sessionserve import LLMEngine
from sessionserve.config import Config
from sessionserve.modelgen import make_model as mm
from sessionserve.server.app import create_app
from sessionserve.workload.http_backend import HttpBackend
from sessionserve.workload.replay import LoadSpec
from sessionserve.workload.sweep import run_http
from sessionserve.workload.trace import AgentSession, Step, ToolCall, TraceSet
from tests.server.conftest import run_app


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = mm.ensure_model("llama", "tiny", tmp_path_factory.mktemp("model-cache"))
    engine = LLMEngine(Config.from_kwargs(num_blocks=256, num_threads=1, host_kv_bytes=0), model)
    with run_app(create_app(engine, model_name="tiny")) as base:
        yield base


def trace() -> TraceSet:
    steps = (Step(40, 4, (ToolCall("tool", 0.002),), "tool"), Step(10, 3, (ToolCall("tool", 0.002),), "tool"),
             Step(6, 3, (), "end", context_kept_tokens=30))
    return TraceSet("tiny", tuple(AgentSession(f"h{i}", steps) for i in range(2)), 1.0, 1.0, ("test",))


@pytest.mark.parametrize("sessions", [True, False])
def test_http_replay_reuses_the_prefix(url: str, sessions: bool) -> None:
    backends: list[HttpBackend] = []

    def make() -> HttpBackend:
        backends.append(HttpBackend(url, supports_sessions=sessions, seed=1))
        return backends[-1]

    (result,) = run_http(trace(), "ours", [LoadSpec("closed", 2)], make, seed=1)["ours"]
    assert all(s.error is None and s.num_steps == 3 for s in result.sessions), [s.error for s in result.sessions]
    second = [r for r in result.steps if r.step_index == 1]
    # The second prompt is the whole history (40 + 4) plus 10 new tokens; the server had most of it.
    assert all(r.result.num_prompt_tokens == 54 for r in second)
    assert all(r.result.num_cached_tokens >= 32 for r in second)
    assert all(r.result.num_prompt_tokens == 36 for r in result.steps if r.step_index == 2)  # kept 30 + 6 new
    assert all(r.result.ttft_s is not None for r in result.steps)
    if sessions:
        assert all(s.stats.get("num_turns") == 3 for s in result.sessions)
