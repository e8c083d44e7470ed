"""The per-tool wait predictor."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sessionserve.core.wait_predictor import WaitPredictor


def test_prior_when_nothing_is_known() -> None:
    p = WaitPredictor(prior_wait_s=4.0).predict(("grep",))
    assert p.p50_s == 4.0 and p.num_samples == 0


def test_learns_per_tool_quantiles() -> None:
    pred = WaitPredictor()
    for i in range(100):
        pred.observe(("grep",), 0.1 + i * 0.001)
        pred.observe(("build",), 30.0 + i * 0.1)
    assert 0.1 <= pred.predict(("grep",)).p50_s <= 0.2
    assert 30.0 <= pred.predict(("build",)).p50_s <= 40.0
    # Concurrent calls resume with the slowest.
    assert pred.predict(("grep", "build")).p50_s == pred.predict(("build",)).p50_s
    # An unknown tool falls back to all observations.
    assert pred.predict(("new-tool",)).num_samples == 0


def test_window_forgets_old_behaviour() -> None:
    pred = WaitPredictor(window=10)
    for _ in range(10):
        pred.observe(("t",), 100.0)
    for _ in range(10):
        pred.observe(("t",), 1.0)
    assert pred.predict(("t",)).p90_s == 1.0


def test_client_hint_sets_the_median() -> None:
    pred = WaitPredictor()
    for _ in range(10):
        pred.observe(("t",), 2.0)
    p = pred.predict(("t",), hint_s=8.0)
    assert p.p50_s == 8.0 and p.p90_s >= 8.0


@settings(max_examples=100, deadline=None, derandomize=True)
@given(ops=st.lists(st.tuples(st.booleans(), st.sampled_from([(), ("Bash",), ("Read",), ("Bash", "Read"), ("Grep",)]),
                              st.floats(0.0, 100.0), st.sampled_from([None, None, 3.0])), min_size=1, max_size=40))
def test_memoized_predictions_equal_fresh_ones(ops) -> None:
    """Predictions are memoized per (tools, hint) until a wait of one of their tools is observed (or any
    wait, for those answered from the global window): at every point they equal a fresh computation."""
    kept = WaitPredictor(window=8, min_samples=2)
    for is_observe, tools, value, hint in ops:
        if is_observe:
            kept.observe(tools, value)
        fresh = WaitPredictor(window=8, min_samples=2)
        fresh._by_tool, fresh._all = kept._by_tool, kept._all  # same history, empty memo
        for key in [((), None), (("Bash",), None), (("Read",), hint), (("Bash", "Read"), None), (("Grep",), 3.0)]:
            assert kept.predict(*key) == fresh.predict(*key)
