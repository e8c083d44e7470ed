"""Prompt lookup and the draft-length policy of speculative decoding (pure parts)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sessionserve.core.spec import SpecPolicy, StepCostFit, ngram_propose


def _naive_ngram(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    total = len(tokens)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = tokens[total - n:]
        for i in range(total - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_ngram_continues_the_latest_longest_match() -> None:
    assert ngram_propose([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]
    assert ngram_propose([7, 9, 1, 2, 5, 1, 2, 6, 2], 1, n_max=1) == [6]  # latest match of [2] wins
    assert ngram_propose([1, 2, 8, 3, 2, 9, 1, 2], 2) == [8, 3]  # [1, 2] beats the later [2]
    assert ngram_propose([5, 6, 7], 2) == []
    assert ngram_propose([3], 2) == [] and ngram_propose([3, 3], 0) == []


def test_ngram_does_not_match_across_token_boundaries() -> None:
    # 256 = bytes 00 01 00 00; 1, 0 packed = 01 00 00 00 00 00 00 00: a byte match that straddles tokens
    assert ngram_propose([256, 1, 0, 256], 2) == [1, 0]
    assert ngram_propose([0, 1 << 8, 5, 1], 2, n_max=1) == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5) | st.integers(0, 1 << 20), min_size=0, max_size=60),
       st.integers(1, 6), st.integers(1, 4), st.integers(1, 4))
def test_ngram_equals_a_plain_search(tokens: list[int], k: int, n_max: int, n_min: int) -> None:
    n_min = min(n_min, n_max)
    assert ngram_propose(tokens, k, n_max, n_min) == _naive_ngram(tokens, k, n_max, n_min)


def test_draft_length_follows_acceptance_and_batch() -> None:
    policy = SpecPolicy(max_tokens=6, saturation_tokens=16)
    ks = [policy.num_draft_tokens(a, 100) for a in (0.02, 0.3, 0.6, 0.9)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 6
    # a big batch makes each verified token cost a full decode: only very likely drafts pay
    assert policy.num_draft_tokens(0.6, 100, batch=64) < policy.num_draft_tokens(0.6, 100, batch=1)
    assert policy.num_draft_tokens(0.9, 3) == 2  # never past max_tokens
    assert policy.num_draft_tokens(0.9, 1) == 0
    assert SpecPolicy(max_tokens=3, adaptive=False).num_draft_tokens(0.0, 100) == 3


def test_acceptance_estimate_counts_trials_up_to_the_first_rejection() -> None:
    policy = SpecPolicy(smoothing=1.0)
    assert policy.update(None, 4, 4) == 1.0
    assert policy.update(None, 4, 1) == 0.5  # one kept, then one rejected
    assert policy.update(None, 4, 0) == 0.0
    low = policy.update(0.0, 0, 0)
    assert low is not None and 0.0 < low < policy.prior  # a sequence that stopped drafting drifts back


def test_step_cost_fit_finds_where_tokens_start_to_cost() -> None:
    fit = StepCostFit()
    for _ in range(5):
        fit.observe(8, 0.010 + 8 * 0.0005)
    assert fit.saturation_tokens() is None  # one batch size: fixed and per-token parts are not separable
    for tokens in (1, 3, 9, 17, 33, 2, 40):
        fit.observe(tokens, 0.010 + tokens * 0.0005)
    fixed, per_token = fit.fit()
    assert abs(fixed - 0.010) < 1e-9 and abs(per_token - 0.0005) < 1e-9
    assert abs(fit.saturation_tokens() - 20.0) < 1e-6
    # the measured saturation drives the policy: a cheap token lets a big batch still draft
    policy = SpecPolicy(max_tokens=4, saturation_tokens=16)
    assert policy.num_draft_tokens(0.6, 100, batch=32, saturation_tokens=400.0) > \
        policy.num_draft_tokens(0.6, 100, batch=32)
