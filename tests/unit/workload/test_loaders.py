"""Every shipped trace loads by name; any folder/file in a supported format loads; scaling and provenance hold."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sessionserve.workload.loader import TRACE_NAMES, default_traces_dir, load_trace, resolve
from sessionserve.workload.mooncake import group_sessions
from sessionserve.workload.trace_io import write_jsonl

TRACES = default_traces_dir()
pytestmark = pytest.mark.skipif(not (TRACES / "weka_claude_code").is_dir(), reason="shared traces not present")


@pytest.mark.parametrize("name", TRACE_NAMES)
def test_each_shipped_trace_loads_with_provenance(name: str) -> None:
    trace = load_trace(name, token_scale=16, time_scale=10, max_sessions=5, max_steps=4)
    assert trace.name == name and 1 <= len(trace.sessions) <= 5
    assert (trace.token_scale, trace.time_scale) == (16, 10)
    assert len(trace.provenance) >= 3 and all(isinstance(p, str) and p for p in trace.provenance)
    for s in trace.sessions:
        assert 2 <= len(s.steps) <= 4 and s.steps[-1].wait_kind == "end" and s.steps[-1].wait_s == 0
        assert all(st.new_input_tokens >= 1 and st.output_tokens >= 1 for st in s.steps)


@pytest.mark.parametrize("name", ["mooncake_conversation", "azure_llm_2023"])
def test_synthesised_tool_waits_are_stated_and_cited(name: str) -> None:
    trace = load_trace(name, max_sessions=3, max_steps=3)
    text = " ".join(trace.provenance)
    assert "synthesised" in text and "TraceLab" in text


def test_token_and_time_scales_divide_and_keep_ratios() -> None:
    full = load_trace("azure_llm_2023", max_sessions=3, max_steps=3)
    scaled = load_trace("azure_llm_2023", max_sessions=3, max_steps=3, token_scale=10, time_scale=4)
    for a, b in zip(full.sessions, scaled.sessions):
        assert b.arrival_s == pytest.approx(a.arrival_s / 4)
        for x, y in zip(a.steps, b.steps):
            assert y.new_input_tokens == max(1, round(x.new_input_tokens / 10))
            assert y.wait_s == pytest.approx(x.wait_s / 4)


def test_mooncake_sessions_share_real_prefix_blocks() -> None:
    trace = load_trace("mooncake_conversation", max_sessions=20, token_scale=32)
    firsts = [s.steps[0] for s in trace.sessions]
    assert all(st.prefix_block_ids[0] == 0 and st.prefix_block_tokens == 16 for st in firsts)  # shared block 0
    rows = [{"hash_ids": h} for h in ([0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 2, 3, 5], [0, 8])]
    # Row 3's deepest shared block (3) was last held by row 1, whose session row 2 already continued: a branch.
    # Row 4 shares only block 0: a new session.
    assert group_sessions(rows) == [[0, 1, 2], [3], [4]]


def test_weka_upstream_json_folder_matches_requests_csv() -> None:
    raw = load_trace(TRACES / "weka_claude_code" / "raw", max_sessions=2, token_scale=64)
    csv = load_trace("weka_claude_code", max_sessions=2, token_scale=64)
    assert raw.sessions == csv.sessions


def test_any_folder_of_supported_files_loads(tmp_path: Path) -> None:
    lines = (TRACES / "mooncake_conversation" / "conversation_trace.jsonl").read_text().splitlines()
    (tmp_path / "part1.jsonl").write_text("\n".join(lines[:600]) + "\n")
    (tmp_path / "part2.jsonl").write_text("\n".join(lines[600:1200]) + "\n")
    assert resolve(tmp_path)[0] == "mooncake"
    trace = load_trace(tmp_path, max_sessions=6, min_steps=1)
    assert len(trace.sessions) == 6 and trace.sessions[0].session_id.startswith("part1/")
    shutil.copy(TRACES / "tracelab_example" / "round_trace.jsonl", tmp_path / "x.jsonl")
    with pytest.raises(ValueError, match="several formats"):
        load_trace(tmp_path)


def test_agent_jsonl_and_bad_inputs(tmp_path: Path) -> None:
    trace = load_trace("tracelab_example", token_scale=8)
    path = write_jsonl(trace, tmp_path / "t.jsonl")
    again = load_trace(path, token_scale=2)
    assert again.token_scale == 16 and len(again.sessions) == len(trace.sessions)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"nothing": 1}) + "\n")
    with pytest.raises(ValueError):
        load_trace(bad)
    with pytest.raises(ValueError, match="no trace"):
        load_trace("no_such_trace")
