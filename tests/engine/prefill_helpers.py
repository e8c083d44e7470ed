"""Shared pieces of the prefill-attention tests: a float32 reference and one engine step's logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sessionserve.cache.kv_manager import KVCacheManager
from sessionserve.types.scheduler_output import ScheduledChunk, SchedulerOutput


def causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos0: int, scale: float) -> torch.Tensor:
    """float32 attention of q (n, H, D) at positions pos0.. over keys k, v (ctx, Hkv, D)."""
    n, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx).unsqueeze(0) <= torch.arange(pos0, pos0 + n).unsqueeze(1)
    o = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.float().transpose(0, 1),
                                       v.float().transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def gather(cache: torch.Tensor, blocks: torch.Tensor, ctx: int) -> torch.Tensor:
    """The first ctx tokens that a block table points at in a paged cache (blocks, Hkv, B, D), as (ctx, Hkv, D)."""
    kv_heads, head_dim = cache.shape[1], cache.shape[3]
    return cache[blocks].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :ctx].transpose(0, 1)


def step_logits(runner, kv: KVCacheManager, chunks: list[tuple], *, tiles: bool, flash: bool):
    """Every row's logits of one engine step over chunks (seq, start, n), with the query-tile kernel and
    the flash-attention path forced on or off; returns (logits, the step's attention metadata)."""
    for seq, start, n in chunks:
        assert kv.allocate(seq.request_id, start + n) is not None
    plan = SchedulerOutput(tuple(ScheduledChunk(s, st, n, st + n == s.num_tokens) for s, st, n in chunks),
                           sum(n for _, _, n in chunks), (), kv.block_tables)
    runner.use_tiles = tiles
    runner.flash_attention = flash
    input_ids, positions, meta, _, _ = runner.prepare_batch(plan)
    meta.sampled = None  # every row's logits: the last layer runs on all of them
    with torch.inference_mode():
        logits = runner.model(input_ids, positions, runner.kv_caches, meta, torch.arange(input_ids.shape[0]))
    return logits.float(), meta
