"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sessionserve.types.guided import GuidedDecoding


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one request.

    temperature 0 means greedy. Bad values raise ValueError with the name of
    the field, so the HTTP layer can return them as 400s.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    # Number of top log-probabilities to return per generated token; None: none.
    logprobs: int | None = None
    # Keep stop strings in the returned text.
    include_stop_str_in_output: bool = False
    # Extra per-request bias on token ids (OpenAI logit_bias).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # OpenAI's penalties on the tokens this request generated: subtracted from a token's logit once if it
    # appeared (presence) and once per time it appeared (frequency). Range [-2, 2]; 0: off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM / HF's multiplicative penalty on every token of the prompt and the output: a positive logit is
    # divided by it, a negative one multiplied. 1: off; > 1 discourages repeats.
    repetition_penalty: float = 1.0
    # Structured output: the text must match this constraint (JSON, a schema, tool calls).
    guided: GuidedDecoding | None = None
    # Let the server draft tokens for this request when speculative decoding is on (False: opt out).
    speculate: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            _check(_is_number(getattr(self, name)), name, "must be a number")
        _check(0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be an integer >= 0")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", "must be in [0, max_tokens]")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
               "logprobs", "must be an integer in [0, 20]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(len(self.stop) <= 16, "stop", "at most 16 stop strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers")
        _check(self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**63), "seed",
               "must be an integer in the int64 range")
        _check(all(-100.0 <= b <= 100.0 for b in self.logit_bias.values()), "logit_bias", "values must be in [-100, 100]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(0.0 < self.repetition_penalty < math.inf, "repetition_penalty", "must be > 0")
        _check(self.guided is None or isinstance(self.guided, GuidedDecoding), "guided", "must be a GuidedDecoding")

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError (naming the field) if a token id this request names is outside the model's vocabulary."""
        for name in ("logit_bias", "stop_token_ids"):
            _check(all(0 <= t < vocab_size for t in getattr(self, name)), name,
                   f"token ids must be in [0, {vocab_size}), this model's vocabulary")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether the logits depend on the tokens seen so far (presence, frequency or repetition penalty)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def can_speculate(self) -> bool:
        """Drafted tokens are verified by plain sampling: not with per-token logits edits or logprobs."""
        return (self.speculate and self.guided is None and self.logprobs is None and not self.logit_bias
                and not self.has_penalties)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"invalid sampling parameter {name}: {why}")
