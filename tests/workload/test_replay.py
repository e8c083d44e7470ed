"""End to end: a tiny in-process replay (tiny model, 3 sessions x 3 steps, ms waits, 2 policies) and its report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sessionserve.modelgen import make_model as mm
from sessionserve.workload.plots import PLOT_FILES
from sessionserve.workload.replay import LoadSpec
from sessionserve.workload.report import write_report
from sessionserve.workload.results import build_results
from sessionserve.workload.sweep import run_inproc
from sessionserve.workload.trace import AgentSession, Step, ToolCall, TraceSet

ENGINE = dict(kv_cache_bytes=2 << 20, host_kv_bytes=8 << 20, num_threads=1, max_num_seqs=8,
              max_num_batched_tokens=256)


def tiny_trace() -> TraceSet:
    def session(i: int) -> AgentSession:
        return AgentSession(f"s{i}", (
            Step(48, 4, (ToolCall("Bash", 0.003), ToolCall("Read", 0.001)), "tool", (0,), 32),  # shared 32 tokens
            Step(12, 3, (ToolCall("Edit", 0.002),), "tool"),
            # s2 compacts its context to 40 tokens before the last step.
            Step(8, 3, (), "end", context_kept_tokens=40 if i == 2 else None),
        ))

    return TraceSet("tiny", tuple(session(i) for i in range(3)), 1.0, 1.0, ("hand-made for the test",))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mm.ensure_model("llama", "tiny", tmp_path_factory.mktemp("model-cache"))


def test_tiny_replay_two_policies_writes_the_report(tiny_model: Path, tmp_path: Path) -> None:
    trace = tiny_trace()
    runs = run_inproc(trace, ["discard", "keep"], [LoadSpec("closed", 3)], tiny_model, ENGINE, seed=0)
    for policy, (result,) in runs.items():
        assert all(s.error is None and s.num_steps == 3 for s in result.sessions), policy
        assert len(result.steps) == 9 and result.extra["leaked_blocks"] == 0
        assert all(r.result.ttft_s is not None and len(r.result.output_token_ids) > 0 for r in result.steps)
        cut = next(r for r in result.steps if r.session_id == "s2" and r.step_index == 2)
        assert cut.result.num_prompt_tokens == 40 + 8  # the kept prefix plus the new tokens
    results = build_results(trace, runs, meta={"command": "test", "model": tiny_model.name,
                                               "settings": {"mode": "closed"}})
    report = write_report(tmp_path / "report", results, runs)
    data = json.loads((tmp_path / "report" / "results.json").read_text())
    assert set(data["policies"]) == {"discard", "keep"} and data["baseline"] == "discard"
    for series in data["policies"].values():
        for key in ("sessions_per_hour_at_slo", "jct_p50_s", "jct_p99_s", "ttft_p50_s", "ttft_p99_s",
                    "recompute_tokens", "prefetch_hit_rate", "vs_baseline", "loads"):
            assert key in series
        assert series["jct_p50_s"] > 0.006  # three steps plus at least 6 ms of tool waits
    assert data["trace"]["token_scale"] == 1.0 and data["trace"]["provenance"] == ["hand-made for the test"]
    text = report.read_text()
    assert "| discard |" in text and "| keep |" in text and "hand-made for the test" in text
    for name in PLOT_FILES:
        assert (tmp_path / "report" / name).stat().st_size > 1000


def test_subagents_replay_on_the_engine_and_share_their_template(tiny_model: Path) -> None:
    from sessionserve.workload.trace import SubAgent

    def child(name: str) -> AgentSession:
        return AgentSession(name, (Step(64, 3, (ToolCall("Grep", 0.002),), "tool", (77,), 48),
                                   Step(10, 2, (), "end")))

    parent = AgentSession("p", (Step(40, 3, (ToolCall("Task", 0.001),), "tool"),
                                Step(12, 3, (ToolCall("Task", 0.001),), "tool"), Step(6, 2, (), "end")),
                          subagents=(SubAgent(0, child("p.sub1"), 0.01), SubAgent(0, child("p.sub2"), 0.01),
                                     SubAgent(1, child("p.sub3"), 0.01)))
    trace = TraceSet("subagents", (parent,), 1.0, 1.0, ("hand-made for the test",))
    runs = run_inproc(trace, ["keep"], [LoadSpec("closed", 1)], tiny_model, ENGINE, seed=0)
    (result,) = runs["keep"]
    assert [s.session_id for s in result.sessions] == ["p"] and result.sessions[0].error is None
    assert sorted(s.session_id for s in result.subagents) == ["p.sub1", "p.sub2", "p.sub3"]
    assert all(s.error is None and s.num_steps == 2 for s in result.subagents)
    assert len(result.steps) == 3 + 3 * 2 and result.extra["leaked_blocks"] == 0
    # The sub-agent started after its siblings ended finds their template (48 tokens: 3 blocks of 16) cached.
    late = next(r for r in result.steps if r.session_id == "p.sub3" and r.step_index == 0)
    assert late.result.num_cached_tokens >= 48
    # The parent's second step came after both of its first sub-agents ended.
    ends = {s.session_id: s.end_s for s in result.subagents}
    second = next(r for r in result.steps if r.session_id == "p" and r.step_index == 1)
    assert second.start_s >= max(ends["p.sub1"], ends["p.sub2"])
