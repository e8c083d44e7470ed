"""Prefill attention as PyTorch's CPU flash attention (the path for float32 on CPUs, and bf16 on CPUs with AMX).

`split_attention` runs wherever the flash op exists, so these tests force the
path on any CPU; choosing it for bf16 (`uses_flash_attention`) depends on AMX and the tile kernel.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sessionserve.cache.kv_manager import KVCacheManager
from sessionserve.config import CacheConfig, ModelConfig
from sessionserve.model.attention import split_attention, uses_flash_attention
from tests.engine.prefill_helpers import causal_reference, gather, step_logits
from tests.unit.core.utils import create_seq

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"),
                                reason="this torch has no CPU flash attention op")

ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(12, 4, 64, 16), (8, 8, 128, 32), (16, 2, 32, 16)])
@pytest.mark.parametrize("n,start", [(32, 1), (40, 15), (64, 16), (100, 1000), (1, 7)])
def test_split_attention_matches_one_masked_softmax(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                                                    block_size: int, n: int, start: int) -> None:
    g = torch.Generator().manual_seed(n * 1000 + start + heads)
    ctx = start + n
    num_blocks = -(-ctx // block_size) + 3
    k_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[: -(-ctx // block_size)]
    keys, values = gather(k_cache, table, ctx), gather(v_cache, table, ctx)
    q = (torch.randn(n, heads, head_dim, generator=g) * 2).to(dtype)  # peaked enough that the mask matters
    scale = head_dim ** -0.5
    prefix = table[: -(-start // block_size)]
    out = split_attention(q, keys[start:], values[start:], k_cache, v_cache, prefix, start, scale)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), causal_reference(q, keys, values, start, scale), atol=ATOL[dtype], rtol=0)


def test_flash_choice_follows_the_dtype_and_cpu() -> None:
    cpu = torch.device("cpu")
    amx = bool(torch.cpu._is_amx_tile_supported())
    assert uses_flash_attention(cpu, torch.float32, tiles=False)
    assert uses_flash_attention(cpu, torch.bfloat16, tiles=True) == amx  # the tiles win without AMX
    assert uses_flash_attention(cpu, torch.bfloat16, tiles=False)
    assert not uses_flash_attention(torch.device("meta"), torch.float32, tiles=False)


def test_engine_prefill_with_flash_is_as_close_to_float32_as_without(tiny_models: dict[str, Path]) -> None:
    """bf16 logits of fresh prefills (two of one length, adjacent, and one apart) and a context chunk,
    flash path on and off, against the fp32 model."""
    from sessionserve.model.runner import ModelRunner

    path = tiny_models["llama"]
    g = torch.Generator().manual_seed(11)
    prompts = {rid: torch.randint(50, 16000, (n,), generator=g).tolist()
               for rid, n in (("a", 60), ("b", 60), ("c", 45), ("d", 60), ("e", 130))}
    results = {}
    for dtype, flash in (("float32", False), ("bfloat16", False), ("bfloat16", True)):
        runner = ModelRunner(path, ModelConfig(device="cpu", dtype=dtype), CacheConfig(block_size=16, num_blocks=96))
        kv = KVCacheManager(runner.num_blocks, 16)
        seqs = {rid: create_seq(len(p), tokens=p, rid=rid) for rid, p in prompts.items()}
        first, meta = step_logits(runner, kv, [(seqs["a"], 0, 60), (seqs["b"], 0, 60), (seqs["c"], 0, 45),
                                               (seqs["d"], 0, 60), (seqs["e"], 0, 50)], tiles=False, flash=flash)
        assert not meta.ctx_split
        second, meta = step_logits(runner, kv, [(seqs["e"], 50, 80)], tiles=False, flash=flash)  # 80 rows over 50
        assert bool(meta.ctx_split) == flash
        results[(dtype, flash)] = torch.cat([first, second])
    exact = results[("float32", False)]
    err_sdpa = (results[("bfloat16", False)] - exact).abs().max().item()
    err_flash = (results[("bfloat16", True)] - exact).abs().max().item()
    assert err_flash <= 1.5 * err_sdpa + 1e-3, (err_flash, err_sdpa)
    agree = (results[("bfloat16", True)].argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert agree >= 0.9
