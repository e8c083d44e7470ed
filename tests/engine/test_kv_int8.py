"""Accuracy cost of int8 KV (the host tier's quantized format), measured on logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sessionserve.cache.kv_layout import gather_blocks, scatter_blocks
from sessionserve.cache.kv_manager import KVCacheManager
from sessionserve.cache.quant import dequantize_int8, quantize_int8
from sessionserve.config import CacheConfig, ModelConfig
from tests.engine.test_logits_vs_hf import run_chunks, tokens
from tests.unit.core.utils import create_seq

BLOCK = 16


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_int8_kv_logit_error_is_small(tiny_models: dict[str, Path], arch: str) -> None:
    from sessionserve.model.runner import ModelRunner

    runner = ModelRunner(tiny_models[arch], ModelConfig(device="cpu", dtype="float32"),
                         CacheConfig(block_size=BLOCK, num_blocks=64))
    kv = KVCacheManager(runner.num_blocks, BLOCK, enable_prefix_caching=False)
    ctx = tokens(96, 21)
    a, b = create_seq(0, tokens=list(ctx)), create_seq(0, tokens=list(ctx))
    run_chunks(runner, kv, [(a, 0, 96)], use_kernel=True)
    assert kv.allocate(b.request_id, 96) is not None
    data = gather_blocks(runner.kv_caches, kv.block_tables[a.request_id])
    q, scales = quantize_int8(data)
    scatter_blocks(runner.kv_caches, kv.block_tables[b.request_id], dequantize_int8(q, scales, data.dtype))
    nxt = tokens(8, 22)
    a.token_ids += nxt
    b.token_ids += nxt
    exact = run_chunks(runner, kv, [(a, 96, 8)], use_kernel=True)
    approx = run_chunks(runner, kv, [(b, 96, 8)], use_kernel=True)
    err = (exact - approx).abs().max().item()
    rel = err / exact.std().item()
    print(f"{arch}: int8 KV max |dlogit| {err:.4f} ({rel:.2%} of the logit std); "
          f"bytes/token fp32 {runner.block_bytes // BLOCK}, int8 ~{runner.block_bytes // BLOCK // 4}")
    assert rel < 0.05
    assert (exact.argmax(-1) == approx.argmax(-1)).float().mean().item() >= 0.75
