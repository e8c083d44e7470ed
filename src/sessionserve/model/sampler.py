"""Picks next tokens from logits: greedy, temperature, top-k, top-p, min-p, penalties, per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sessionserve.types.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleRow:
    """Sampling inputs for one row of the logits."""

    params: SamplingParams
    generator: torch.Generator | None  # per-request stream when a seed was given
    banned: tuple[int, ...] = ()  # e.g. EOS before min_tokens
    output_ids: list[int] | None = None  # tokens generated so far; set when the params penalize repeats
    prompt_ids: torch.Tensor | None = None  # the prompt's distinct token ids (int64), for repetition_penalty


def apply_penalties(logits: torch.Tensor, params: SamplingParams, output_ids: list[int],
                    prompt_ids: torch.Tensor | None) -> None:
    """Edit one row of logits (V,) in place: repetition (prompt and output), then frequency and presence (output).

    The semantics of vLLM (and HF's `repetition_penalty`): a seen token's
    positive logit is divided by the repetition penalty, a negative one
    multiplied; OpenAI's frequency penalty is subtracted once per time a token
    was generated, the presence penalty once if it was generated at all.
    Only the seen tokens' logits are read and written (`prompt_ids`: the
    prompt's distinct ids), not the whole vocabulary.
    """
    ids = torch.tensor(output_ids, dtype=torch.long, device=logits.device)
    generated, counts = torch.unique(ids, return_counts=True)
    if params.repetition_penalty != 1.0:
        seen = generated if prompt_ids is None else \
            torch.cat((prompt_ids, generated[~torch.isin(generated, prompt_ids)]))
        vals, r = logits[seen], params.repetition_penalty
        logits[seen] = torch.where(vals > 0, vals / r, vals * r)
    if params.frequency_penalty or params.presence_penalty:
        logits[generated] -= counts.to(logits.dtype) * params.frequency_penalty + params.presence_penalty


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


def sample(logits: torch.Tensor, rows: list[SampleRow], *, in_place: bool = False) -> torch.Tensor:
    """Next token per row of `logits` (S, V) -> (S,) int64 on the CPU.

    Bans, logit bias and penalties edit a copy of `logits`, or `logits` itself when `in_place`
    (the caller has no further use for the raw values)."""
    needs_edit = [i for i, r in enumerate(rows) if r.banned or r.params.logit_bias or r.output_ids is not None]
    if needs_edit:
        logits = logits if in_place else logits.clone()
        for i in needs_edit:
            r = rows[i]
            if r.params.logit_bias:
                ids = torch.tensor(list(r.params.logit_bias), device=logits.device)
                vals = torch.tensor(list(r.params.logit_bias.values()), device=logits.device, dtype=logits.dtype)
                logits[i].index_add_(0, ids, vals)
            if r.output_ids is not None:
                apply_penalties(logits[i], r.params, r.output_ids, r.prompt_ids)
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


def verify_sampled(logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                   row: SampleRow) -> tuple[list[int], int]:
    """Speculative sampling: the accepted prefix of `drafts` and one more token from the target.

    `logits` (k + 1, V): the target's logits at the last token and at each
    draft; `draft_probs` (k, V): the proposer's distributions (None: each draft
    was proposed with certainty, as prompt lookup does). Draft i is kept with
    probability min(1, p(d) / q(d)); at the first rejection the token is drawn
    from the residual max(0, p - q), renormalised; if all are kept, from the
    target's next distribution. The output is distributed exactly as sampling
    the target alone (Leviathan et al. 2023, Chen et al. 2023).
    """
    params = row.params
    logits = logits.float()
    probs = torch.stack([logits_to_probs(logits[i], params.temperature, params.top_k, params.top_p, params.min_p)
                         for i in range(logits.shape[0])])
    gen = row.generator
    uniforms = torch.rand(len(drafts), generator=gen, device=probs.device).tolist()
    for i, d in enumerate(drafts):
        p = probs[i]
        q_d = float(draft_probs[i, d]) if draft_probs is not None else 1.0
        p_d = float(p[d])
        if q_d > 0 and uniforms[i] * q_d < p_d:
            continue
        if draft_probs is not None:
            residual = (p - draft_probs[i].to(p.dtype)).clamp_(min=0)
        else:
            residual = p.clone()
            residual[d] = 0
        total = float(residual.sum())
        if total <= 0:  # p == q up to rounding: any draw from p is exact
            residual = p
        token = int(torch.multinomial(residual, 1, generator=gen))
        return drafts[:i], token
    token = int(torch.multinomial(probs[len(drafts)], 1, generator=gen))
    return list(drafts), token
