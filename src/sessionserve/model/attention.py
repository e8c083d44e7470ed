"""Attention over the paged KV cache for a flattened batch of prefill chunks and decode tokens.

KV cache layout per layer: (num_blocks, num_kv_heads, block_size, head_dim).
A head's slice of a block is contiguous, which suits both the CPU decode
kernel (it streams keys block by block) and gathering a sequence's context
into (H, T, D) for SDPA.

A step's tokens are flattened: sequence i owns rows [cu_q[i], cu_q[i+1]).
Three paths, chosen per sequence:
  - fresh prefill (no cached context): SDPA, causal, on the chunk's own K/V;
    equal-length chunks are stacked into one batched call;
  - decode and context prefill (chunks after a prefix-cache hit or an earlier
    chunk): the paged kernel (C++ on CPU) or, where it is unavailable, a
    gather of the context followed by SDPA with an offset causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sessionserve.model import paged_kernel


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs about one step's batch, built once per step."""

    slot_block: torch.Tensor  # (T,) int64: block id each new token's K/V goes to
    slot_offset: torch.Tensor  # (T,) int64: offset inside that block
    # Fresh prefills grouped by chunk length: (row_start_of_each_seq (n,), length).
    fresh_groups: list[tuple[list[int], int]]
    # Rows and sequences served by the paged path (decode + context prefill).
    paged_rows: torch.Tensor | None  # (Tp,) int64 row indices into the flat batch
    paged_seq_idx: torch.Tensor | None  # (Tp,) int32 index into paged_block_tables
    paged_pos: torch.Tensor | None  # (Tp,) int32 absolute position of each query
    paged_block_tables: torch.Tensor | None  # (Sp, max_blocks) int32
    paged_ctx_lens: list[int]  # per paged sequence: context length after this step
    paged_q_spans: list[tuple[int, int]]  # per paged sequence: (first row in paged_rows, num rows)
    use_kernel: bool


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Store this step's K/V (T, Hkv, D) into their cache slots. Mutates the caches."""
    k_cache[meta.slot_block, :, meta.slot_offset] = k
    v_cache[meta.slot_block, :, meta.slot_offset] = v


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention for the flat batch; K/V must already be written. Returns (T, H, D)."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    gqa = num_heads != num_kv_heads
    for starts, length in meta.fresh_groups:
        if len(starts) == 1:
            s = starts[0]
            qs, ks, vs = q[s:s + length], k[s:s + length], v[s:s + length]
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                is_causal=True, scale=scale, enable_gqa=gqa)  # (H, L, D)
            out[s:s + length] = o.transpose(0, 1)
        else:
            idx = torch.tensor(starts, device=q.device).unsqueeze(1) + torch.arange(length, device=q.device)
            qs, ks, vs = q[idx], k[idx], v[idx]  # (B, L, H, D)
            o = F.scaled_dot_product_attention(
                qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2),
                is_causal=True, scale=scale, enable_gqa=gqa)  # (B, H, L, D)
            out[idx] = o.transpose(1, 2)
    if meta.paged_rows is not None:
        qp = q[meta.paged_rows]
        if meta.use_kernel:
            op = paged_kernel.paged_attention(qp, k_cache, v_cache, meta.paged_block_tables,
                                              meta.paged_seq_idx, meta.paged_pos, scale)
        else:
            op = _paged_attention_gather(qp, k_cache, v_cache, meta, scale)
        out[meta.paged_rows] = op
    return out


def _paged_attention_gather(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Portable path: gather each sequence's context, then SDPA with an offset causal mask."""
    assert meta.paged_block_tables is not None and meta.paged_pos is not None
    out = torch.empty_like(q)
    block_size = k_cache.shape[2]
    gqa = q.shape[1] != k_cache.shape[1]
    for i, (row0, num_rows) in enumerate(meta.paged_q_spans):
        ctx_len = meta.paged_ctx_lens[i]
        num_blocks = (ctx_len + block_size - 1) // block_size
        blocks = meta.paged_block_tables[i, :num_blocks].long()
        ks = k_cache[blocks].transpose(0, 1).reshape(k_cache.shape[1], -1, k_cache.shape[3])[:, :ctx_len]
        vs = v_cache[blocks].transpose(0, 1).reshape(v_cache.shape[1], -1, v_cache.shape[3])[:, :ctx_len]
        qs = q[row0:row0 + num_rows].transpose(0, 1)  # (H, n, D)
        pos = meta.paged_pos[row0:row0 + num_rows].long()
        mask = torch.arange(ctx_len, device=q.device).unsqueeze(0) <= pos.unsqueeze(1)  # (n, ctx)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[row0:row0 + num_rows] = o.transpose(0, 1)
    return out
