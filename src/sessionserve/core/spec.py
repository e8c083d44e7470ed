"""Speculative decoding policy: which sequences draft, how many tokens, and prompt lookup.

Pure: no torch, no clock. A step of speculative decoding has a sequence's
last token plus k proposed tokens verified by the target model in one forward
(the scheduler gives that decode chunk 1 + k tokens); the target keeps the
longest accepted prefix and adds one token of its own, so a step yields 1 to
k + 1 tokens. Proposals come from a draft model (model/drafter.py) or, with no
second model, from prompt lookup: the continuation of the latest earlier
occurrence of the context's last n tokens, which is how agents' outputs often
look (arguments and code copied out of tool results).

How many tokens to propose is per sequence: the expected tokens per step for
k drafts at acceptance rate a is (1 - a^(k+1)) / (1 - a), the cost grows with
k; `SpecPolicy.num_draft_tokens` picks the k with the best ratio, from a
running estimate of the sequence's own acceptance.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

from sessionserve.types.sequence import Sequence

METHODS = ("none", "ngram", "draft")


def ngram_propose(tokens: Seq[int], k: int, n_max: int = 4, n_min: int = 1, window: int = 8192) -> list[int]:
    """Up to `k` tokens that followed the latest earlier match of the context's last n tokens.

    Tries n = n_max down to n_min and takes the first n with a match; among the
    matches of that n the latest one wins (recent text is the likeliest to be
    copied). Only the last `window` tokens are searched. [] when nothing matches.
    The search runs over the tokens as packed 32-bit integers with bytes.rfind,
    so a step costs microseconds even for long contexts.
    """
    if k <= 0 or len(tokens) < 2:
        return []
    ctx = list(tokens[-window:])
    total = len(ctx)
    buf = array("i", ctx).tobytes()
    width = buf and len(buf) // total
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        pattern = buf[(total - n) * width:]
        end = (total - 1) * width  # a match must end before the last token: something follows it
        while True:
            at = buf.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % width == 0:  # aligned on a token, not straddling two
                start = at // width + n
                return ctx[start:start + k]
            end = at + len(pattern) - 1
    return []


class StepCostFit:
    """Decode step time as `fixed + per_token * tokens`, fitted by exponentially weighted least squares.

    `saturation_tokens()` = fixed / per_token: the batch at which tokens cost
    as much as the step's fixed part (reading the weights, launching the
    layers), which is where verifying drafts stops being nearly free. None
    until the observed batches spread enough to tell the two apart.
    """

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self._w = d * self._w + 1
        self._x = d * self._x + tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + tokens * tokens
        self._xy = d * self._xy + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None without enough spread in batch sizes."""
        var = self._w * self._xx - self._x * self._x
        if self._w < 8 or var <= 0.5 * self._w * self._w:  # token counts' std-dev under ~0.7
            return None
        per_token = (self._w * self._xy - self._x * self._y) / var
        fixed = (self._y - per_token * self._x) / self._w
        return (fixed, per_token) if fixed > 0 and per_token > 0 else None

    def saturation_tokens(self) -> float | None:
        fit = self.fit()
        return None if fit is None else min(4096.0, max(1.0, fit[0] / fit[1]))


class NgramProposer:
    """Prompt lookup: proposals from the sequence's own context, no model."""

    forward_s = None

    def __init__(self, n_max: int = 4, n_min: int = 1) -> None:
        self.n_max, self.n_min = n_max, n_min

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> None:
        for seq, k in zip(seqs, num_tokens):
            seq.spec_token_ids = ngram_propose(seq.token_ids, k, self.n_max, self.n_min)
            seq.spec_probs = None


@dataclass(frozen=True)
class SpecPolicy:
    """How many tokens to draft, from a sequence's acceptance estimate.

    Costs are per draft token, as a fraction of one decode step. Verifying a
    draft is nearly free while a step is bound by reading the weights (small
    batches) and costs nearly a whole step's share once the step is bound by
    arithmetic: `verify_cost` + x / (1 + x) with x = batch /
    `saturation_tokens`, the batch at which the per-token part of a step
    equals its fixed part: about where the device turns compute-bound (tens
    of tokens on a CPU, hundreds on a GPU; the engine measures it with
    `StepCostFit` once it has seen a few batch sizes). `draft_cost`: the
    proposer's cost per drafted token (0 for prompt lookup).
    """

    max_tokens: int = 4
    adaptive: bool = True
    verify_cost: float = 0.05
    saturation_tokens: int = 16
    draft_cost: float = 0.0
    prior: float = 0.6  # acceptance assumed before a sequence has any history
    smoothing: float = 0.3  # weight of the latest step in the running estimate

    def __post_init__(self) -> None:
        if not 0 <= self.max_tokens <= 32:
            raise ValueError(f"num_speculative_tokens must be in [0, 32], got {self.max_tokens}")

    def num_draft_tokens(self, acceptance: float | None, remaining: int, batch: int = 1,
                         draft_cost: float | None = None, saturation_tokens: float | None = None) -> int:
        """k for the next step: the best expected tokens per unit cost, at most `remaining` - 1.

        `batch`: sequences decoding in the step; `draft_cost`, `saturation_tokens`: measured
        values (`StepCostFit`, the proposer's timing) instead of the configured ones.
        """
        cap = min(self.max_tokens, max(0, remaining - 1))
        if cap == 0 or not self.adaptive:
            return cap
        a = self.prior if acceptance is None else min(max(acceptance, 0.0), 0.999)
        saturation = self.saturation_tokens if saturation_tokens is None else saturation_tokens
        # A step of `batch` tokens takes fixed + batch * per_token; one more token adds per_token, i.e.
        # x / (1 + x) of the step with x = batch / saturation (= batch * per_token / fixed).
        x = batch / saturation
        cost = self.verify_cost + x / (1 + x) + (self.draft_cost if draft_cost is None else draft_cost)
        best_k, best = 0, 1.0
        for k in range(1, cap + 1):
            value = ((1 - a ** (k + 1)) / (1 - a)) / (1 + cost * k)
            if value > best + 1e-9:
                best_k, best = k, value
        return best_k

    def update(self, acceptance: float | None, proposed: int, accepted: int) -> float | None:
        """The running per-token acceptance after a step that verified `proposed` drafts.

        A step stops at the first rejection, so `accepted` of `proposed` tells
        about accepted + 1 trials (or `proposed` when all were accepted).
        """
        if proposed <= 0:
            # No draft this step: drift back toward the prior so a sequence that stopped drafting
            # (estimate too low to pay) tries again later.
            if acceptance is None:
                return None
            return acceptance + 0.05 * (self.prior - acceptance)
        trials = proposed if accepted == proposed else accepted + 1
        rate = accepted / trials
        if acceptance is None:
            return rate
        return (1 - self.smoothing) * acceptance + self.smoothing * rate


class Proposer(Protocol):
    """Fills `seq.spec_token_ids` (and `seq.spec_probs` for sampled proposals) for the next step.

    `forward_s`: measured seconds per proposed token position (one batched draft forward), or
    None when proposing costs nothing worth counting.
    """

    forward_s: float | None

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> None:
        """Propose up to num_tokens[i] tokens after the last token of seqs[i] (fewer, or none, is fine)."""
        ...
