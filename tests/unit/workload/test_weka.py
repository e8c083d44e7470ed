"""The weka_claude_code loader on the shared trace (skipped if the trace is not beside the repo)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sessionserve.workload.weka import load_weka

TRACE = Path(__file__).resolve().parents[3].parent / "shared" / "traces" / "weka_claude_code" / "requests.csv"
pytestmark = pytest.mark.skipif(not TRACE.is_file(), reason="shared traces not present")


def test_loads_sessions_with_growing_context_and_real_waits() -> None:
    sessions = load_weka(TRACE, max_sessions=20)
    assert len(sessions) == 20
    first = sessions[0]
    assert first.session_id == "trace_0001"
    assert first.steps[0].new_input_tokens == 71175 and first.steps[0].output_tokens == 169
    # Step 1 sends only what the context gained: 72762 - (71175 + 169).
    assert first.steps[1].new_input_tokens == 72762 - 71175 - 169
    assert first.steps[0].wait_s == 12.0 and first.steps[0].wait_kind == "tool"
    assert all(s.steps[-1].wait_kind == "end" and s.steps[-1].wait_s == 0 for s in sessions)


def test_scaling_and_cuts_are_applied() -> None:
    full = load_weka(TRACE, max_sessions=5)
    scaled = load_weka(TRACE, max_sessions=5, token_scale=100, time_scale=10, max_steps=4, min_steps=4,
                       max_context_tokens=5000)
    assert all(len(s.steps) <= 4 for s in scaled)
    assert all(s.num_tokens <= 5000 for s in scaled)
    a, b = full[0].steps[0], scaled[0].steps[0]
    assert b.new_input_tokens == round(a.new_input_tokens / 100)
    assert b.wait_s == pytest.approx(a.wait_s / 10)


def test_same_input_same_sessions() -> None:
    assert load_weka(TRACE, max_sessions=10, token_scale=64) == load_weka(TRACE, max_sessions=10, token_scale=64)


def test_subagents_start_after_the_marker_and_share_their_template() -> None:
    sessions = load_weka(TRACE, subagents=True, only_with_subagents=True)
    # 63 sub-agents in 17 sessions; trace_0004's two start at its last call, so nothing waits for them.
    assert len(sessions) == 16 and sum(len(s.subagents) for s in sessions) == 61
    by_id = {s.session_id: s for s in sessions}
    t10 = by_id["trace_0010"]
    assert [(a.after_step, a.session.session_id, len(a.session.steps)) for a in t10.subagents] == [
        (0, "trace_0010.sub1", 7), (8, "trace_0010.sub2", 5), (8, "trace_0010.sub3", 14),
        (8, "trace_0010.sub4", 24)]
    # The parent's recorded wait after call 8 (325 s) covers its three sub-agents (the longest 309.8 s).
    assert all(a.blocking for a in t10.subagents)
    assert t10.expected_wait_s(8) == pytest.approx(325.0)
    assert t10.steps[8].wait_s == pytest.approx(325.0 - 309.8)
    # Siblings share the sub-agent template (156 blocks of 64 tokens seen before), not the parent's context.
    firsts = [a.session.steps[0] for a in t10.subagents]
    assert len({f.prefix_block_ids for f in firsts}) == 1 and firsts[0].prefix_block_ids != (0,)
    assert [f.prefix_block_tokens for f in firsts] == [156 * 64] * 4
    # trace_0295's sub-agents after call 64 ran in the background: the parent went on after 16 s.
    t295 = by_id["trace_0295"]
    assert [a.blocking for a in t295.subagents_after(64)] == [False, False, False]
    assert t295.steps[64].wait_s == pytest.approx(16.0)
    # Without the option, nothing changes.
    plain = load_weka(TRACE, max_sessions=20)
    assert plain == load_weka(TRACE, max_sessions=20, subagents=False) and not any(s.subagents for s in plain)


def test_raw_files_and_csv_give_the_same_subagents() -> None:
    raw = TRACE.parent / "raw"
    from_raw = load_weka(raw, subagents=True, only_with_subagents=True, token_scale=64)
    from_csv = {s.session_id: s for s in load_weka(TRACE, subagents=True, only_with_subagents=True, token_scale=64)}
    assert from_raw and all(s == from_csv[s.session_id] for s in from_raw)
