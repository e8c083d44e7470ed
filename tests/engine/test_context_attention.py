"""Causal attention over a gathered context (the path of long context chunks without flash attention or
tiles, and of short ones without the paged kernel) against one dense masked softmax; fresh prefills are
the case rows == context."""

from __future__ import annotations

import pytest
import torch

from sessionserve.model import attention
from tests.engine.prefill_helpers import gather


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q (n, H, D), the last n positions of keys k, v (ctx, Hkv, D): scores, mask, softmax and sum written out."""
    n, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    k, v = (t.float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1) for t in (k, v))  # (H, ctx, D)
    scores = q.float().transpose(0, 1) @ k.transpose(1, 2) * scale  # (H, n, ctx)
    visible = torch.arange(ctx).unsqueeze(0) <= torch.arange(ctx - n, ctx).unsqueeze(1)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return (probs @ v).transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,rows,ctx", [(12, 4, 40, 300), (8, 8, 33, 100), (12, 4, 64, 64),
                                                     (14, 2, 200, 1000), (12, 4, 300, 300), (8, 8, 1, 50)])
def test_context_attention_matches_one_masked_softmax(dtype: torch.dtype, heads: int, kv_heads: int, rows: int,
                                                      ctx: int) -> None:
    g = torch.Generator().manual_seed(rows * ctx)
    head_dim, block_size = 64, 16
    num_blocks = (ctx + block_size - 1) // block_size
    k_cache = torch.randn(num_blocks + 3, kv_heads, block_size, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks + 3, kv_heads, block_size, head_dim, generator=g).to(dtype)
    blocks = torch.randperm(num_blocks + 3, generator=g)[:num_blocks]
    q = (torch.randn(rows, heads, head_dim, generator=g) * 2).to(dtype)  # peaked enough that the mask matters
    got = attention.context_attention(q, k_cache, v_cache, blocks, ctx, 0.125)
    want = dense_reference(q, gather(k_cache, blocks, ctx), gather(v_cache, blocks, ctx), 0.125)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)
