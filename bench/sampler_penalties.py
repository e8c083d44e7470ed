"""The sampler with repetition, frequency and presence penalties: editing only the seen tokens' logits (ours)
vs the whole-vocabulary edit (a count per vocabulary entry, then `where` over every logit; what HF-style
dense processors and our sampler before did), one decode step's batch at a time.

    .venv/bin/python bench/sampler_penalties.py [--threads 1] [--repeats 7]

Each case: `--batch` rows of random logits, each with its own generated ids
and a 512-token prompt, greedy, all three penalties on. Both paths must give
bit-identical logits and the same tokens (checked); median of `--repeats`
timed calls after one warm-up.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from bench.timing import timed_ms
from sessionserve import SamplingParams
from sessionserve.model.sampler import SampleRow, sample

CASES = ((16_384, 32, 256), (128_256, 32, 256), (151_936, 32, 256), (151_936, 8, 1024))  # vocab, rows, output


def dense_penalties(logits: torch.Tensor, params: SamplingParams, output_ids: list[int],
                    prompt_seen: torch.Tensor) -> None:
    """The baseline: counts and masks the size of the vocabulary, every logit rewritten."""
    vocab = logits.shape[-1]
    counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)[:vocab]
    seen = (counts > 0) | prompt_seen
    r = params.repetition_penalty
    logits.copy_(torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits))
    counts = counts.to(logits.dtype)
    logits.sub_(counts * params.frequency_penalty + (counts > 0).to(logits.dtype) * params.presence_penalty)


def dense_sample(logits: torch.Tensor, params: SamplingParams, outputs: list[list[int]],
                 masks: list[torch.Tensor]) -> torch.Tensor:
    for i in range(logits.shape[0]):
        dense_penalties(logits[i], params, outputs[i], masks[i])
    return logits.argmax(dim=-1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=0, repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2)
    print("| vocab | rows | generated per row | whole vocabulary ms | seen tokens only ms | speedup |")
    print("|---|---|---|---|---|---|")
    for vocab, rows, out_len in CASES:
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(rows, vocab, generator=g)
        outputs = [torch.randint(0, vocab, (out_len,), generator=g).tolist() for _ in range(rows)]
        prompts = [torch.randint(0, vocab, (512,), generator=g) for _ in range(rows)]
        masks = [torch.zeros(vocab, dtype=torch.bool).index_fill_(0, q, True) for q in prompts]
        sample_rows = [SampleRow(params, None, (), outputs[i], torch.unique(prompts[i])) for i in range(rows)]
        a, b = logits.clone(), logits.clone()
        want = dense_sample(a, params, outputs, masks)
        got = sample(b, sample_rows, in_place=True)
        assert torch.equal(a, b) and torch.equal(want, got), "the two paths disagree"
        t_dense = timed_ms(lambda: dense_sample(logits.clone(), params, outputs, masks), args.repeats)
        t_ours = timed_ms(lambda: sample(logits.clone(), sample_rows, in_place=True), args.repeats)
        print(f"| {vocab:,} | {rows} | {out_len} | {t_dense:.2f} | {t_ours:.2f} | "
              f"{t_dense / t_ours:.2f}x |")


if __name__ == "__main__":
    main()
