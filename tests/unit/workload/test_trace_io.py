"""JSONL trace I/O: round trip of every field, version and format checks, scaling helpers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sessionserve.workload.trace import (
    SCHEMA_VERSION,
    AgentSession,
    Step,
    SubAgent,
    ToolCall,
    TraceSet,
    with_batch_fraction,
)
from sessionserve.workload.trace_io import is_agent_jsonl, read_jsonl, write_jsonl


def make_trace() -> TraceSet:
    s1 = AgentSession("a", (
        Step(100, 10, (ToolCall("Bash", 0.5, 0), ToolCall("Read", 0.1, 0), ToolCall("Edit", 2.0, 1)), "tool",
             prefix_block_ids=(0, 7), prefix_block_tokens=32),
        Step(20, 5, (ToolCall("user", 30.0),), "human", context_kept_tokens=40),
        Step(3, 2, (), "end"),
    ), arrival_s=1.5, source="test", meta={"k": 1})
    child = AgentSession("b.sub1", (Step(40, 4, (ToolCall("Grep", 1.0),), "tool", prefix_block_ids=(9,),
                                         prefix_block_tokens=30), Step(5, 2, (), "end")))
    s2 = AgentSession("b", (Step(7, 1, (ToolCall("tool", 0.5),), "tool"), Step(3, 1, (), "end")), priority="batch",
                      subagents=(SubAgent(0, child, 12.0), SubAgent(0, child, 30.0, blocking=False)))
    return TraceSet("unit", (s1, s2), token_scale=4.0, time_scale=2.0, provenance=("made by hand",))


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    trace = make_trace()
    path = write_jsonl(trace, tmp_path / "sub" / "t.jsonl")
    assert is_agent_jsonl(path)
    assert read_jsonl(path) == trace
    header = json.loads(path.read_text().splitlines()[0])
    assert header["version"] == SCHEMA_VERSION and header["format"] == "sessionserve.agent_trace"


def test_wait_is_sum_over_groups_of_longest_call() -> None:
    assert make_trace().sessions[0].steps[0].wait_s == pytest.approx(0.5 + 2.0)


def test_newer_version_and_other_formats_are_refused(tmp_path: Path) -> None:
    path = write_jsonl(make_trace(), tmp_path / "t.jsonl")
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    header["version"] = SCHEMA_VERSION + 1
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="version"):
        read_jsonl(path)
    other = tmp_path / "o.jsonl"
    other.write_text('{"timestamp": 0}\n')
    assert not is_agent_jsonl(other)
    with pytest.raises(ValueError, match="not a"):
        read_jsonl(other)


def test_scaled_and_truncated() -> None:
    trace = make_trace()
    scaled = trace.scaled(token_scale=2.0, time_scale=4.0)
    assert (scaled.token_scale, scaled.time_scale) == (8.0, 8.0)
    a, b = trace.sessions[0], scaled.sessions[0]
    assert b.steps[0].new_input_tokens == 50 and b.steps[0].prefix_block_tokens == 16
    assert b.steps[1].context_kept_tokens == 20
    assert b.steps[0].wait_s == pytest.approx(a.steps[0].wait_s / 4)
    assert b.arrival_s == pytest.approx(1.5 / 4)
    cut = trace.truncated(2).sessions[0]
    assert len(cut.steps) == 2 and cut.steps[-1].wait_kind == "end" and cut.steps[-1].wait_s == 0


def test_batch_fraction_is_deterministic_and_order_free() -> None:
    sessions = tuple(AgentSession(f"s{i}", (Step(5, 1, (), "end"),)) for i in range(40))
    marked = with_batch_fraction(sessions, 0.25, seed=3)
    batch = {s.session_id for s in marked if s.priority == "batch"}
    assert len(batch) == 10
    assert {s.session_id for s in with_batch_fraction(sessions[::-1], 0.25, seed=3) if s.priority == "batch"} == batch
    assert {s.session_id for s in with_batch_fraction(sessions, 0.25, seed=4) if s.priority == "batch"} != batch
    assert [s.session_id for s in marked] == [s.session_id for s in sessions]
    with pytest.raises(ValueError):
        with_batch_fraction(sessions, 1.5, seed=0)


def test_subagents_scale_truncate_and_set_the_expected_wait() -> None:
    parent = make_trace().sessions[1]
    assert parent.expected_wait_s(0) == pytest.approx(12.0 + 0.5)  # blocking sub-agents, then its own tools
    scaled = make_trace().scaled(token_scale=2.0, time_scale=4.0).sessions[1]
    assert scaled.subagents[0].duration_s == pytest.approx(3.0)
    assert scaled.subagents[0].session.steps[0].new_input_tokens == 20
    assert scaled.subagents[0].session.steps[0].prefix_block_tokens == 15
    # Cut to one step: nothing would wait for sub-agents started after it.
    assert make_trace().truncated(1).sessions[1].subagents == ()
