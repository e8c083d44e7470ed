"""Causal attention over a context: float32 GEMMs on CPU (row blocks over the keys each block sees)
against SDPA with the same mask; fresh prefills are the case rows == context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sessionserve.model import attention


@pytest.mark.parametrize("heads,kv_heads,rows,ctx", [(12, 4, 40, 300), (8, 8, 33, 100), (12, 4, 64, 64),
                                                     (14, 2, 200, 1000), (12, 4, 300, 300), (8, 8, 1, 50)])
@pytest.mark.parametrize("row_block", [None, 7])
def test_gemm_context_attention_matches_sdpa(monkeypatch, heads: int, kv_heads: int, rows: int, ctx: int,
                                             row_block: int | None) -> None:
    if row_block is not None:  # several row blocks per call, the last one short
        monkeypatch.setattr(attention, "_SCORE_ELEMS", heads * ctx * row_block)
    g = torch.Generator().manual_seed(rows * ctx)
    head_dim, block_size = 64, 16
    num_blocks = (ctx + block_size - 1) // block_size
    k_cache = torch.randn(num_blocks + 3, kv_heads, block_size, head_dim, generator=g)
    v_cache = torch.randn(num_blocks + 3, kv_heads, block_size, head_dim, generator=g)
    blocks = torch.randperm(num_blocks + 3, generator=g)[:num_blocks]
    q = torch.randn(rows, heads, head_dim, generator=g)
    mask = attention.context_mask(ctx, torch.arange(ctx - rows, ctx))
    got = attention.context_attention(q, k_cache, v_cache, blocks, ctx, 0.125)
    ks = k_cache[blocks].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :ctx]
    vs = v_cache[blocks].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :ctx]
    want = F.scaled_dot_product_attention(q.transpose(0, 1), ks, vs, attn_mask=mask, scale=0.125,
                                          enable_gqa=heads != kv_heads).transpose(0, 1)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
