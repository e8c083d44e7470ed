"""Our decoder's logits against Hugging Face transformers on the same weights (fp32).

Covers plain prefill, chunked prefill, decode and prefix-cache hits, for
every architecture, through both attention paths (C++ kernel and gather).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sessionserve.cache.kv_manager import KVCacheManager
from sessionserve.config import CacheConfig, ModelConfig
from sessionserve.types.scheduler_output import ScheduledChunk, SchedulerOutput
from tests.unit.core.utils import create_seq

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
BLOCK = 16


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def pair(request: pytest.FixtureRequest, tiny_models: dict[str, Path]):
    from sessionserve.model.runner import ModelRunner

    path = tiny_models[request.param]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner(path, ModelConfig(device="cpu", dtype="float32"), CacheConfig(block_size=BLOCK, num_blocks=64))
    return hf, runner


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()  # (T, V)


def run_chunks(runner, kv: KVCacheManager, chunks: list[tuple], use_kernel: bool) -> torch.Tensor:
    """Run (seq, start, n) chunks in one step; return logits for every computed row."""
    input_ids, positions, meta, _ = prepare(runner, kv, chunks, use_kernel)
    meta.sampled = None  # every row's logits: the last layer runs on all of them
    rows = torch.arange(input_ids.shape[0])
    with torch.inference_mode():
        return runner.model(input_ids, positions, runner.kv_caches, meta, rows)


def run_sampled(runner, kv: KVCacheManager, chunks: list[tuple], use_kernel: bool) -> torch.Tensor:
    """Run (seq, start, n) chunks in one step as the engine does: logits of each finished chunk's last row."""
    input_ids, positions, meta, rows = prepare(runner, kv, chunks, use_kernel)
    with torch.inference_mode():
        return runner.model(input_ids, positions, runner.kv_caches, meta, rows)


def prepare(runner, kv: KVCacheManager, chunks: list[tuple], use_kernel: bool):
    for seq, start, n in chunks:
        assert kv.allocate(seq.request_id, start + n) is not None
    plan = SchedulerOutput(tuple(ScheduledChunk(s, st, n, st + n == s.num_tokens) for s, st, n in chunks),
                           sum(n for _, _, n in chunks), (), kv.block_tables)
    input_ids, positions, meta, rows, _ = runner.prepare_batch(plan)
    for m in (meta, meta.sampled):
        if m is not None:
            m.use_kernel = use_kernel and runner.use_kernel
    return input_ids, positions, meta, rows


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(50, 16000, (n,), generator=g).tolist()


@pytest.mark.parametrize("use_kernel", [True, False])
def test_prefill_matches_hf(pair, use_kernel: bool) -> None:
    hf, runner = pair
    kv = KVCacheManager(runner.num_blocks, BLOCK)
    a, b = create_seq(0, tokens=tokens(37, 1)), create_seq(0, tokens=tokens(37, 2))
    c = create_seq(0, tokens=tokens(20, 3))
    ours = run_chunks(runner, kv, [(a, 0, 37), (b, 0, 37), (c, 0, 20)], use_kernel)
    ref = torch.cat([hf_logits(hf, a.token_ids), hf_logits(hf, b.token_ids), hf_logits(hf, c.token_ids)])
    assert (ours - ref).abs().max().item() <= ATOL


@pytest.mark.parametrize("use_kernel", [True, False])
def test_chunked_prefill_and_decode_match_hf(pair, use_kernel: bool) -> None:
    hf, runner = pair
    kv = KVCacheManager(runner.num_blocks, BLOCK)
    full = tokens(45, 4)
    seq = create_seq(0, tokens=full[:40])
    ref = hf_logits(hf, full)
    first = run_chunks(runner, kv, [(seq, 0, 13)], use_kernel)
    second = run_chunks(runner, kv, [(seq, 13, 27)], use_kernel)  # chunk spanning blocks, with context
    assert (torch.cat([first, second]) - ref[:40]).abs().max().item() <= ATOL
    for pos in range(40, 45):  # decode one token at a time
        seq.token_ids.append(full[pos])
        out = run_chunks(runner, kv, [(seq, pos, 1)], use_kernel)
        assert (out[0] - ref[pos]).abs().max().item() <= ATOL


@pytest.mark.parametrize("use_kernel", [True, False])
def test_prefix_cache_hit_matches_hf(pair, use_kernel: bool) -> None:
    hf, runner = pair
    kv = KVCacheManager(runner.num_blocks, BLOCK)
    shared = tokens(34, 5)
    a = create_seq(0, tokens=shared)
    run_chunks(runner, kv, [(a, 0, 34)], use_kernel)
    kv.commit_full_blocks(a.request_id, a.token_ids, 34)
    b_tokens = shared[:32] + tokens(9, 6)
    b = create_seq(0, tokens=b_tokens)
    hit = kv.find_cached_prefix(b.request_id, b.token_ids)
    assert hit.num_tokens == 32
    assert kv.allocate(b.request_id, 41, hit) is not None
    # A decode of `a` in the same step as b's prefill after the hit: a mixed batch.
    a.token_ids.append(tokens(1, 7)[0])
    out = run_chunks(runner, kv, [(a, 34, 1), (b, 32, 9)], use_kernel)
    assert (out[0] - hf_logits(hf, a.token_ids)[-1]).abs().max().item() <= ATOL
    assert (out[1:] - hf_logits(hf, b_tokens)[32:]).abs().max().item() <= ATOL
    assert kv.block_tables[b.request_id][:2] == kv.block_tables[a.request_id][:2]


@pytest.mark.parametrize("flash", [True, False])
def test_long_context_chunk_matches_hf(pair, monkeypatch, flash: bool) -> None:
    """An agent's next turn: many new rows over a cached context (split flash attention, or the gather path
    where the paged kernel runs)."""
    hf, runner = pair
    monkeypatch.setattr(runner, "flash_attention", flash and runner.flash_attention)
    kv = KVCacheManager(runner.num_blocks, BLOCK)
    full = tokens(50 + runner.gather_min_rows + 8, 8)
    seq, other = create_seq(0, tokens=full), create_seq(0, tokens=tokens(20, 9))
    run_chunks(runner, kv, [(seq, 0, 50), (other, 0, 20)], use_kernel=True)
    other.token_ids.append(tokens(1, 10)[0])
    chunks = [(other, 20, 1), (seq, 50, len(full) - 50)]  # a decode and the long chunk in one step
    for s, start, n in chunks:
        assert kv.allocate(s.request_id, start + n) is not None
    plan = SchedulerOutput(tuple(ScheduledChunk(s, st, n, st + n == s.num_tokens) for s, st, n in chunks),
                           sum(n for _, _, n in chunks), (), kv.block_tables)
    _, _, meta, _, _ = runner.prepare_batch(plan)
    assert bool(meta.ctx_split) == runner.flash_attention
    assert bool(meta.ctx_gather) == (runner.use_kernel and not runner.use_tiles and not runner.flash_attention)
    out = run_chunks(runner, kv, chunks, use_kernel=True)
    assert (out[0] - hf_logits(hf, other.token_ids)[-1]).abs().max().item() <= ATOL
    assert (out[1:] - hf_logits(hf, full)[50:]).abs().max().item() <= ATOL


@pytest.mark.parametrize("use_kernel", [True, False])
def test_sampled_rows_match_hf(pair, use_kernel: bool) -> None:
    """The engine's own steps: the last layer runs past its K/V only on the rows it samples."""
    hf, runner = pair
    kv = KVCacheManager(runner.num_blocks, BLOCK)
    a_tokens, b_tokens, c_tokens = tokens(30, 11), tokens(40, 12), tokens(25, 13)
    a, b = create_seq(0, tokens=a_tokens[:20]), create_seq(0, tokens=b_tokens)
    assert run_sampled(runner, kv, [(b, 0, 17)], use_kernel).shape[0] == 0  # a chunk that samples nothing
    first = run_sampled(runner, kv, [(a, 0, 20)], use_kernel)
    a.token_ids.extend(a_tokens[20:21])
    c = create_seq(0, tokens=c_tokens)
    # One step: a's decode, b's last chunk over its first (whose last layer K/V came from a step that
    # sampled nothing), c's fresh prefill.
    out = run_sampled(runner, kv, [(a, 20, 1), (b, 17, 23), (c, 0, 25)], use_kernel)
    assert out.shape[0] == 3
    assert (first[0] - hf_logits(hf, a_tokens[:20])[-1]).abs().max().item() <= ATOL
    assert (out[0] - hf_logits(hf, a_tokens[:21])[-1]).abs().max().item() <= ATOL
    assert (out[1] - hf_logits(hf, b_tokens)[-1]).abs().max().item() <= ATOL
    assert (out[2] - hf_logits(hf, c_tokens)[-1]).abs().max().item() <= ATOL
