"""Distil a draft from its target: the target's next-token distributions, on the text a draft predicts.

``distill_model`` trains a small model (usually ``SHAPES["draft"]`` or
``"mini"``) to match a trained target (KL), half of each batch on corpus text
and half on the target's own greedy continuations of corpus prompts: what a
draft sees when it drafts for that target.  ``training.json`` records, beside
the common fields, the teacher, the continuation settings and the draft's
greedy agreement with the teacher on continuations of held-out prompts (the
per-token acceptance of greedy speculative decoding).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sessionserve.modelgen.train import (
    Corpus,
    TrainConfig,
    TrainingRun,
    TrainResult,
    TrainShape,
    sample_batch,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@torch.no_grad()
def teacher_continuations(teacher: PreTrainedModel, ids: torch.Tensor, num_sequences: int, prompt_len: int,
                          gen_len: int, gen: torch.Generator, batch_size: int = 32) -> torch.Tensor:
    """(num_sequences, prompt_len + gen_len) token ids: random corpus windows of prompt_len tokens, each
    continued greedily by `teacher` for gen_len tokens (what a draft must predict when it drafts for it)."""
    teacher.eval()
    out = []
    for i in range(0, num_sequences, batch_size):
        prompts = sample_batch(ids, min(batch_size, num_sequences - i), prompt_len - 1, gen)
        seqs = teacher.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=gen_len,
                                min_new_tokens=gen_len, do_sample=False,
                                pad_token_id=int(teacher.config.pad_token_id or 0))
        out.append(seqs[:, :prompt_len + gen_len])
    return torch.cat(out)


def distill_loss(student: PreTrainedModel, teacher: PreTrainedModel, batch: torch.Tensor,
                 use_bf16: bool) -> torch.Tensor:
    """KL(teacher || student) of the next-token distributions at every position of a (B, T+1) batch."""
    inputs = batch[:, :-1]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
        target = F.log_softmax(teacher(input_ids=inputs, use_cache=False).logits.float(), dim=-1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
        logits = student(input_ids=inputs, use_cache=False).logits
    return F.kl_div(F.log_softmax(logits.float(), dim=-1).flatten(0, 1), target.flatten(0, 1), log_target=True,
                    reduction="batchmean")


@torch.no_grad()
def greedy_agreement(student: PreTrainedModel, data: torch.Tensor, prompt_len: int) -> float:
    """Share of teacher-generated positions where the student's argmax is the teacher's next token: the
    acceptance rate of greedy speculative decoding with this draft, one token at a time."""
    student.eval()
    hits = total = 0
    for i in range(0, len(data), 8):
        seqs = data[i:i + 8]
        pred = student(input_ids=seqs[:, :-1], use_cache=False).logits.argmax(-1)[:, prompt_len - 1:]
        hits += int((pred == seqs[:, prompt_len:]).sum())
        total += pred.numel()
    student.train()
    return hits / max(1, total)


def distill_model(
    out_dir: str | Path,
    teacher_dir: str | Path,
    shape: TrainShape,
    train: TrainConfig | None = None,
    *,
    arch: str = "llama",
    role: str = "draft",
    cache_dir: Path | None = None,
    corpus: Corpus | None = None,
    num_sequences: int = 1024,
    prompt_len: int = 128,
) -> TrainResult:
    """Train a draft for the model in `teacher_dir` by distillation and write its HF folder (see the module)."""
    from transformers import AutoModelForCausalLM

    train = train if train is not None else TrainConfig()
    gen_len = train.seq_len + 1 - prompt_len
    if gen_len < 1:
        raise ValueError(f"prompt_len {prompt_len} leaves nothing to generate in seq_len {train.seq_len}")
    run = TrainingRun.start(shape, train, arch=arch, role=role, cache_dir=cache_dir, corpus=corpus)
    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.float32).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(train.seed)
    t0 = time.perf_counter()
    data = teacher_continuations(teacher, run.corpus.train_ids, num_sequences, prompt_len, gen_len, gen)
    held_out = teacher_continuations(teacher, run.corpus.eval_ids, 64, prompt_len, gen_len, gen)
    generate_s = time.perf_counter() - t0
    half = max(1, train.batch_size // 2)

    def next_loss() -> torch.Tensor:
        rows = torch.randint(0, len(data), (train.batch_size - half,), generator=gen)
        batch = torch.cat([sample_batch(run.corpus.train_ids, half, train.seq_len, gen), data[rows]])
        return distill_loss(run.model, teacher, batch, run.use_bf16)

    run.fit(next_loss)
    return run.finish(out_dir, {
        "distilled": True,
        "teacher": str(teacher_dir),
        "distill": {"num_sequences": num_sequences, "prompt_len": prompt_len, "gen_len": gen_len,
                    "generate_s": round(generate_s, 2),
                    "greedy_agreement_held_out": greedy_agreement(run.model, held_out, prompt_len)},
    })
