"""Sampler logits edits against their definitions: OpenAI's presence/frequency penalties, HF's repetition penalty."""

from __future__ import annotations

import pytest
import torch

from sessionserve import SamplingParams
from sessionserve.model.sampler import SampleRow, apply_penalties, sample

transformers = pytest.importorskip("transformers")

V = 50


def openai_penalties(logits: torch.Tensor, output_ids: list[int], presence: float, frequency: float) -> torch.Tensor:
    """The formula of OpenAI's docs, token by token: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    out = logits.clone()
    for j in range(out.shape[0]):
        c = output_ids.count(j)
        out[j] -= c * frequency + (1.0 if c > 0 else 0.0) * presence
    return out


@pytest.mark.parametrize("presence, frequency", [(0.5, 0.0), (0.0, 0.7), (1.5, -0.3), (-2.0, 2.0)])
def test_presence_and_frequency_follow_openai(presence: float, frequency: float) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(V, generator=g)
    output_ids = [3, 3, 7, 49, 3, 0]
    got = logits.clone()
    apply_penalties(got, SamplingParams(presence_penalty=presence, frequency_penalty=frequency), output_ids, None)
    torch.testing.assert_close(got, openai_penalties(logits, output_ids, presence, frequency))


@pytest.mark.parametrize("penalty", [0.5, 1.3, 4.0])
def test_repetition_penalty_equals_hf_over_prompt_and_output(penalty: float) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(V, generator=g) * 3
    prompt, output = [1, 2, 2, 9, 30], [9, 11, 44, 11]  # 9 in both, 11 twice: each penalized once
    got = logits.clone()
    apply_penalties(got, SamplingParams(repetition_penalty=penalty), output, torch.tensor([1, 2, 9, 30]))
    hf = transformers.RepetitionPenaltyLogitsProcessor(penalty)
    want = hf(torch.tensor([prompt + output]), logits.clone()[None])[0]
    torch.testing.assert_close(got, want)


def test_no_output_yet_penalizes_only_the_prompt() -> None:
    logits = torch.ones(V)
    apply_penalties(logits, SamplingParams(repetition_penalty=2.0, presence_penalty=1.0), [], torch.tensor([4]))
    assert logits[4] == 0.5 and logits[5] == 1.0 and (logits == 1.0).sum() == V - 1


def test_repetition_without_a_prompt_set_penalizes_the_output_only() -> None:
    logits = torch.full((V,), -1.0)
    apply_penalties(logits, SamplingParams(repetition_penalty=3.0), [5, 5, 6], None)
    assert logits[5] == logits[6] == -3.0 and (logits == -1.0).sum() == V - 2


def test_greedy_sample_takes_the_penalized_logits() -> None:
    logits = torch.zeros(2, V)
    logits[:, 7] = 1.0  # the greedy choice of both rows...
    logits[:, 8] = 0.9
    params = SamplingParams(temperature=0, frequency_penalty=0.2)
    rows = [SampleRow(params, None, (), output_ids=[7]), SampleRow(params, None, (), output_ids=[8])]
    assert sample(logits, rows).tolist() == [8, 7]  # ...until it was generated before
    assert logits[0, 7] == 1.0  # the caller's logits are not edited


@pytest.mark.parametrize("kwargs", [{"presence_penalty": 2.5}, {"frequency_penalty": -3.0},
                                    {"repetition_penalty": 0.0}, {"repetition_penalty": float("nan")},
                                    {"repetition_penalty": float("inf")}, {"presence_penalty": None},
                                    {"repetition_penalty": "1.2"}, {"frequency_penalty": True},
                                    {"temperature": "0.7"}])
def test_bad_penalties_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="invalid sampling parameter"):
        SamplingParams(**kwargs)


def test_large_repetition_penalty_is_accepted() -> None:
    assert SamplingParams(repetition_penalty=12.0).has_penalties  # vLLM only asks for > 0


def test_rows_without_penalties_keep_their_logits_in_a_mixed_batch() -> None:
    logits = torch.zeros(2, V)
    logits[:, 7] = 1.0
    logits[:, 8] = 0.9
    penalized = SamplingParams(temperature=0, presence_penalty=0.5)
    plain = SamplingParams(temperature=0)
    rows = [SampleRow(penalized, None, (), output_ids=[7]), SampleRow(plain, None, ())]
    assert sample(logits, rows).tolist() == [8, 7]


def test_penalties_turn_off_speculation() -> None:
    assert SamplingParams().can_speculate
    assert not SamplingParams(presence_penalty=0.1).can_speculate
    assert not SamplingParams(repetition_penalty=1.1).can_speculate


def test_in_place_sampling_edits_the_given_logits() -> None:
    logits = torch.zeros(1, V)
    logits[0, 7] = 1.0
    banned = SampleRow(SamplingParams(temperature=0), None, (7,))
    assert sample(logits, [banned], in_place=True).tolist() == [0]  # the first of the remaining zeros
    assert logits[0, 7] == float("-inf")  # no copy made: the caller said it has no use for the raw values
