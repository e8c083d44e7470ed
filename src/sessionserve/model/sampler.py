"""Picks next tokens from logits: greedy, temperature, top-k, top-p, min-p, per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sessionserve.core.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleRow:
    """Sampling inputs for one row of the logits."""

    params: SamplingParams
    generator: torch.Generator | None  # per-request stream when a seed was given
    banned: tuple[int, ...] = ()  # e.g. EOS before min_tokens


def logits_to_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                    min_p: float) -> torch.Tensor:
    """Probabilities (V,) after temperature and the top-k / top-p / min-p filters."""
    logits = logits / max(temperature, 1e-5)
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cum = sorted_probs.cumsum(-1)
        drop = (cum - sorted_probs) > top_p  # keep the smallest set whose mass reaches top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Next token per row of `logits` (S, V) -> (S,) int64 on the CPU."""
    needs_edit = [i for i, r in enumerate(rows) if r.banned or r.params.logit_bias]
    if needs_edit:
        logits = logits.clone()
        for i in needs_edit:
            r = rows[i]
            if r.params.logit_bias:
                ids = torch.tensor(list(r.params.logit_bias), device=logits.device)
                vals = torch.tensor(list(r.params.logit_bias.values()), device=logits.device, dtype=logits.dtype)
                logits[i].index_add_(0, ids, vals)
            if r.banned:
                logits[i, list(r.banned)] = float("-inf")
    out = logits.argmax(dim=-1)
    for i, r in enumerate(rows):
        p = r.params
        if p.is_greedy:
            continue
        probs = logits_to_probs(logits[i], p.temperature, p.top_k, p.top_p, p.min_p)
        # Exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) samples from p.
        noise = torch.empty_like(probs).exponential_(generator=r.generator)
        out[i] = (probs / noise).argmax()
    return out.cpu()


def top_logprobs(logits: torch.Tensor, chosen: torch.Tensor, num: int) -> list[dict[int, float]]:
    """Per row: the chosen token's logprob and the top-`num` (under the raw model distribution)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    result: list[dict[int, float]] = []
    top = torch.topk(logprobs, num, dim=-1) if num > 0 else None
    for i in range(logits.shape[0]):
        row: dict[int, float] = {}
        token = int(chosen[i])
        row[token] = float(logprobs[i, token])
        if top is not None:
            for value, idx in zip(top.values[i].tolist(), top.indices[i].tolist()):
                row.setdefault(int(idx), float(value))
        result.append(row)
    return result
