"""Tests for trained embedded models (model/train.py, ``make-model --train``).

A tiny target/draft pair is trained once per module for a few dozen steps on
a small slice of the stdlib corpus: the loss must fall, the folders must match
the random models' files, and our engine and HF must give the same logits.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from sessionserve.modelgen import distill as ds
from sessionserve.modelgen import make_model as mm
from sessionserve.modelgen import train as tr

transformers = pytest.importorskip("transformers")

TINY_DRAFT = tr.TrainShape(hidden_size=32, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                           intermediate_size=64, head_dim=32)
FAST = tr.TrainConfig(num_steps=40, batch_size=4, seq_len=64, lr=1e-2, max_corpus_bytes=300_000,
                      num_eval_windows=8, log_every=0)
SHARED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
ATOL = 1e-4


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> tuple[tr.TrainResult, tr.TrainResult]:
    out = tmp_path_factory.mktemp("trained")
    return tr.train_pair(out, FAST, target_shape=tr.SHAPES["tiny"], draft_shape=TINY_DRAFT, cache_dir=model_cache)


def test_loss_decreases(pair: tuple[tr.TrainResult, tr.TrainResult]) -> None:
    for result in pair:
        r = json.loads((result.path / "training.json").read_text())
        assert r == json.loads(json.dumps(result.record))
        assert r["num_steps_done"] == FAST.num_steps and r["stopped_by"] == "steps"
        # Untrained: about ln(16384) = 9.7 nats; a few steps already learn the unigram statistics.
        assert r["final_eval_loss"] < r["initial_eval_loss"] - 1.0, r
        assert r["final_train_loss"] < r["initial_eval_loss"] - 1.0, r
        assert r["corpus"]["num_eval_files"] > 0 and r["corpus"]["num_train_files"] > r["corpus"]["num_eval_files"]
        assert r["distilled"] is False
    assert pair[0].record["num_params"] > pair[1].record["num_params"]


def test_folders_match_random_models(pair: tuple[tr.TrainResult, tr.TrainResult], tiny_llama: Path) -> None:
    for result in pair:
        assert {p.name for p in result.path.iterdir()} == {p.name for p in tiny_llama.iterdir()} | {"training.json"}
        for name in SHARED_FILES:
            assert (result.path / name).read_bytes() == (tiny_llama / name).read_bytes(), name
    target, draft = (json.loads((r.path / "config.json").read_text()) for r in pair)
    assert target["vocab_size"] == draft["vocab_size"] == mm.VOCAB_SIZE
    assert target["torch_dtype"] == "float32" and target["num_hidden_layers"] > draft["num_hidden_layers"]


@pytest.mark.parametrize("role", [0, 1], ids=["target", "draft"])
def test_ours_and_hf_give_same_logits(pair: tuple[tr.TrainResult, tr.TrainResult], role: int) -> None:
    from sessionserve import LLM, SamplingParams

    path = pair[role].path
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                 output_loading_info=True)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(key), f"{key}: {info.get(key)}"
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt = tok.encode("import os\n\n\ndef main(argv):\n    for name in ", add_special_tokens=False)
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_blocks=64)
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5))[0]
    generated, logprobs = out.outputs[0].token_ids, out.outputs[0].logprobs
    assert logprobs is not None and len(logprobs) == len(generated) == 8
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + list(generated)])).logits[0].float(), dim=-1)  # (T, V)
    for i, (token, row) in enumerate(zip(generated, logprobs)):
        ref_row = ref[len(prompt) - 1 + i]
        assert token == int(ref_row.argmax())
        for tid, lp in row.items():
            assert abs(lp - float(ref_row[tid])) <= ATOL, (i, tid)


def test_same_seed_same_weights(tmp_path: Path, model_cache: Path) -> None:
    short = tr.TrainConfig(num_steps=3, batch_size=2, seq_len=32, max_corpus_bytes=300_000, num_eval_windows=2,
                           log_every=0)
    tok_path = tr.ensure_tokenizer(model_cache)
    corpus = tr.load_corpus(tok_path, short.max_corpus_bytes, short.eval_file_stride)
    a, b = (tr.train_model(tmp_path / name, TINY_DRAFT, short, cache_dir=model_cache, corpus=corpus).path
            for name in ("a", "b"))
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_time_cap_stops_after_one_step(tmp_path: Path, model_cache: Path) -> None:
    capped = tr.TrainConfig(num_steps=50, batch_size=2, seq_len=32, max_corpus_bytes=300_000, num_eval_windows=2,
                            max_train_s=1e-6, log_every=0)
    r = tr.train_model(tmp_path / "m", TINY_DRAFT, capped, cache_dir=model_cache).record
    assert r["num_steps_done"] == 1 and r["stopped_by"] == "time"


def test_lr_schedule() -> None:
    cfg = tr.TrainConfig(num_steps=101, lr=1e-3, warmup_ratio=0.1, min_lr_ratio=0.1)
    lrs = [tr.lr_at(tr.budget_progress(s, 0.0, cfg), cfg) for s in range(101)]
    assert lrs[0] == pytest.approx(1e-3 / 101) and lrs[10] == pytest.approx(1e-3)
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))
    assert lrs[-1] == pytest.approx(1e-4)
    # Under a time cap, the schedule follows time when it runs ahead of the steps.
    capped = tr.TrainConfig(num_steps=101, max_train_s=10.0)
    assert tr.budget_progress(5, 5.0, capped) == pytest.approx(0.5)
    assert tr.budget_progress(50, 1.0, capped) == pytest.approx(0.5)


def test_cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, pair: tuple[tr.TrainResult, tr.TrainResult],
             capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[tuple] = []
    monkeypatch.setattr(tr, "train_pair", lambda out, cfg, **kw: calls.append((out, cfg, kw)) or pair)
    mm.main(["--train", "--pair", "--train-steps", "7", "--train-minutes", "0.5", "--out", str(tmp_path)])
    out, cfg, kw = calls[0]
    assert out == tmp_path and cfg.num_steps == 7 and cfg.max_train_s == 30.0 and kw["arch"] == "llama"
    assert str(pair[0].path) in capsys.readouterr().out
    assert tr.pair_dirs(None, tmp_path) == (tmp_path / "trained-target", tmp_path / "trained-draft")
    for bad in (["--pair"], ["--train-steps", "3"], ["--train", "--size", "tiny"]):
        with pytest.raises(SystemExit):
            mm.main(bad)


def test_distilled_draft_agrees_with_its_target_more(tmp_path: Path, model_cache: Path,
                                                      pair: tuple[tr.TrainResult, tr.TrainResult]) -> None:
    """A draft distilled from the target predicts the target's greedy tokens more often than the draft
    trained on the corpus alone, for the same steps: what makes speculative decoding pay."""
    from transformers import AutoModelForCausalLM

    target, plain = pair
    result = ds.distill_model(tmp_path / "d", target.path, TINY_DRAFT, FAST, cache_dir=model_cache,
                              num_sequences=64, prompt_len=32)
    r = json.loads((result.path / "training.json").read_text())
    assert r["distilled"] is True and r["teacher"] == str(target.path) and r["num_steps_done"] == FAST.num_steps
    assert {p.name for p in result.path.iterdir()} == {p.name for p in plain.path.iterdir()}
    corpus = tr.load_corpus(tr.ensure_tokenizer(model_cache), FAST.max_corpus_bytes, FAST.eval_file_stride)
    teacher = AutoModelForCausalLM.from_pretrained(str(target.path), dtype=torch.float32)
    held_out = ds.teacher_continuations(teacher, corpus.eval_ids, 32, 32, FAST.seq_len + 1 - 32,
                                        torch.Generator().manual_seed(7))
    students = {name: AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
                for name, path in (("distilled", result.path), ("plain", plain.path))}
    agree = {name: ds.greedy_agreement(m, held_out, 32) for name, m in students.items()}
    # A target this briefly trained may continue every prompt with the same few tokens, which both drafts
    # then predict (agreement 1.0 each): the distributions tell them apart.
    with torch.no_grad():
        kl = {name: float(ds.distill_loss(m, teacher, held_out, use_bf16=False)) for name, m in students.items()}
    assert kl["distilled"] < kl["plain"], kl
    assert agree["distilled"] >= agree["plain"], agree
    assert 0.0 < r["distill"]["greedy_agreement_held_out"] <= 1.0
