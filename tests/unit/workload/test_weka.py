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
