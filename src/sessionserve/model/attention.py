"""Attention over the paged KV cache for a flattened batch of prefill chunks and decode tokens.

KV cache layout per layer: (num_blocks, num_kv_heads, block_size, head_dim).
A head's slice of a block is contiguous, which suits both the CPU decode
kernel (it streams keys block by block) and gathering a sequence's context
into (H, T, D) for SDPA.

A step's tokens are flattened: sequence i owns rows [cu_q[i], cu_q[i+1]).
Paths, chosen per sequence:
  - on a CPU in float32, and in bfloat16 with AMX or without the tile kernel
    (`uses_flash_attention`): PyTorch's CPU flash attention; fresh prefills causal on their own rows
    (SDPA, equal-length chunks stacked into one call), context prefills of at
    least SPLIT_MIN_ROWS rows in two calls (the cached prefix unmasked, the
    chunk causal on itself) merged by their log-sum-exp;
  - bfloat16 on a CPU with AVX512-BF16 and no AMX (`tile_attention.py`):
    every fresh prefill, and every context prefill of at least TILE_MIN_ROWS
    tokens, in one call of the query-tile kernel, which reads keys from the
    chunk's own rows or through the block table;
  - otherwise, fresh prefill (no cached context): SDPA, causal, with
    equal-length chunks stacked into one call; context prefill (chunks after
    a prefix-cache hit or an earlier chunk, an agent's every next turn) of at
    least `gather_min_rows` tokens: a gather of the sequence's context, then
    SDPA under an offset causal mask;
  - decode and short context chunks (speculative verification): the paged
    kernel (C++ on CPU, one query row at a time, streaming the context) or,
    where it is unavailable, the gather and SDPA above.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F

from sessionserve.model import paged_kernel, tile_attention

# Context chunks shorter than this stay on the paged kernel: the tile kernel repacks the whole
# context per KV head (and the gather path copies it), which only pays off over enough query rows.
TILE_MIN_ROWS = 16
# Without tiles, context chunks of this many rows and more gather their context for SDPA; the paged
# kernel streams the whole context once per row (2 threads, fp32, 12/4 heads of 64: break-even at
# 16-32 rows, gather 1.8x faster at 32 rows over 1k tokens, 3.7x at 64 over 4k).
GATHER_MIN_ROWS = 32
# With flash attention, context chunks of this many rows and more take the split flash attention
# (`split_attention`); shorter ones the tile kernel or the paged one. 2 threads, 12/4 heads of 64, bf16 on
# AMX against the tile kernel: 256 rows over 2,048 tokens 3.7 ms vs 11.1, 8 x 32 rows over 1,024 5.1 vs 7.9,
# 16 x 16 over 512 5.6 vs 4.9. float32 on an AVX2 EPYC against the AVX2 paged kernel: 16 rows over 2,000
# tokens 2.5 ms vs 2.0, 32 over 1,000-3,000 about even, 64 over 2,000 6.0 vs 8.0, 128 over 3,500 18 vs 31.
SPLIT_MIN_ROWS = 32


class AttentionPath(Enum):
    """Which attention code computes a chunk's rows."""

    FRESH = "fresh"  # a chunk at position 0: its own keys only (SDPA), grouped by length
    FRESH_TILES = "fresh_tiles"  # ... on the bf16 tile kernel
    CONTEXT_SPLIT = "context_split"  # after cached tokens: two flash-attention calls merged
    CONTEXT_TILES = "context_tiles"  # ... the tile kernel reading keys through the block table
    CONTEXT_GATHER = "context_gather"  # ... the context gathered, then SDPA under a mask
    PAGED = "paged"  # the paged kernel (or its torch fallback): decode and short context chunks


@dataclass(frozen=True)
class AttentionCaps:
    """What this runner's attention can use (from the device, dtype and CPU features, fixed at load)."""

    tiles: bool = False  # the bf16 tile kernel loaded (AVX512-BF16)
    flash: bool = False  # PyTorch's CPU flash attention takes prefills (float32; bf16 on AMX or without tiles)
    paged_kernel: bool = False  # our paged-attention kernel loaded
    gather_min_rows: int = GATHER_MIN_ROWS  # context chunks this long gather their context


def attention_path(start: int, num_rows: int, caps: AttentionCaps) -> AttentionPath:
    """The path of a chunk of `num_rows` query rows starting at position `start`. Pure."""
    if start == 0:
        return AttentionPath.FRESH_TILES if caps.tiles and not caps.flash else AttentionPath.FRESH
    if caps.flash and num_rows >= SPLIT_MIN_ROWS:
        return AttentionPath.CONTEXT_SPLIT
    if caps.tiles and num_rows >= TILE_MIN_ROWS:
        return AttentionPath.CONTEXT_TILES
    if caps.paged_kernel and num_rows >= caps.gather_min_rows:
        return AttentionPath.CONTEXT_GATHER
    return AttentionPath.PAGED


@dataclass(slots=True)
class TileBatch:
    """Sequences for the tile kernel: query rows, first positions and (paged) block tables."""

    q_start: torch.Tensor  # (S,) int32: first row of each sequence in the flat batch
    q_len: torch.Tensor  # (S,) int32
    pos0: torch.Tensor  # (S,) int32: position of each sequence's first query
    block_tables: torch.Tensor | None  # (S, max_blocks) int32; None: keys are the batch's own rows


class TileBatchBuilder:
    """Collects a step's sequences for one tile call."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int]] = []
        self.tables: list[list[int]] = []

    def add(self, row0: int, num_rows: int, pos0: int, table: list[int] | None = None) -> None:
        self.rows.append((row0, num_rows, pos0))
        if table is not None:
            self.tables.append(table)

    def build(self, device: torch.device) -> TileBatch | None:
        if not self.rows:
            return None
        cols = torch.tensor(self.rows, dtype=torch.int32, device=device).t().contiguous()
        return TileBatch(cols[0], cols[1], cols[2], pad_tables(self.tables, device) if self.tables else None)


def pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables as one (S, max_blocks) int32 tensor, zero-padded."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)


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
    tile_fresh: TileBatch | None = None  # fresh prefills for the tile kernel
    tile_ctx: TileBatch | None = None  # context prefills for the tile kernel
    # Context prefills for the gather path: (first row, num rows, block ids, context length, the causal
    # mask's bias where SDPA needs one (built once per step for every layer), else None).
    ctx_gather: list[tuple[int, int, torch.Tensor, int, torch.Tensor | None]] | None = None
    # Context prefills for `split_attention`: (first row, num rows, block ids of the cached prefix (int64),
    # prefix length).
    ctx_split: list[tuple[int, int, torch.Tensor, int]] | None = None
    # The last layer's attention for the sampled rows only (all paged, in logits-row order), when the
    # step has rows it does not sample (prefill chunks); None: every row is sampled.
    sampled: AttentionMetadata | None = None


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
    if meta.tile_fresh is not None:
        t = meta.tile_fresh
        tile_attention.tile_attention_(out, q, k, v, t.q_start, t.q_len, t.pos0, None, scale)
    if meta.tile_ctx is not None:
        t = meta.tile_ctx
        tile_attention.tile_attention_(out, q, k_cache, v_cache, t.q_start, t.q_len, t.pos0, t.block_tables, scale)
    for starts, length in meta.fresh_groups:
        if len(starts) == 1 or starts == list(range(starts[0], starts[0] + len(starts) * length, length)):
            # adjacent chunks of one length (the usual case): (B, L, H, D) views, no gather
            s, rows = starts[0], len(starts) * length
            qs, ks, vs = (t[s:s + rows].unflatten(0, (len(starts), length)) for t in (q, k, v))
            o = F.scaled_dot_product_attention(
                qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2),
                is_causal=True, scale=scale, enable_gqa=gqa)  # (B, H, L, D)
            out[s:s + rows] = o.transpose(1, 2).flatten(0, 1)
        else:
            idx = torch.tensor(starts, device=q.device).unsqueeze(1) + torch.arange(length, device=q.device)
            qs, ks, vs = q[idx], k[idx], v[idx]  # (B, L, H, D)
            o = F.scaled_dot_product_attention(
                qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2),
                is_causal=True, scale=scale, enable_gqa=gqa)  # (B, H, L, D)
            out[idx] = o.transpose(1, 2)
    for row0, n, blocks, start in meta.ctx_split or ():
        rows = slice(row0, row0 + n)
        out[rows] = split_attention(q[rows], k[rows], v[rows], k_cache, v_cache, blocks, start, scale)
    for row0, n, blocks, ctx_len, mask in meta.ctx_gather or ():
        out[row0:row0 + n] = context_attention(q[row0:row0 + n], k_cache, v_cache, blocks, ctx_len, scale, mask)
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
    """Portable path: gather each sequence's context, then causal attention over it."""
    assert meta.paged_block_tables is not None
    out = torch.empty_like(q)
    block_size = k_cache.shape[2]
    for i, (row0, num_rows) in enumerate(meta.paged_q_spans):
        ctx_len = meta.paged_ctx_lens[i]
        blocks = meta.paged_block_tables[i, :(ctx_len + block_size - 1) // block_size].long()
        out[row0:row0 + num_rows] = context_attention(q[row0:row0 + num_rows], k_cache, v_cache, blocks, ctx_len,
                                                      scale)
    return out


def context_mask(ctx_len: int, pos: torch.Tensor) -> torch.Tensor:
    """(n, ctx_len) bool: query row i at position pos[i] sees context tokens 0..pos[i]."""
    return torch.arange(ctx_len, device=pos.device).unsqueeze(0) <= pos.unsqueeze(1)


def mask_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`mask` (bool, True = visible) as the additive bias SDPA takes: 0 or -inf."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def uses_flash_attention(device: torch.device, dtype: torch.dtype, tiles: bool) -> bool:
    """Whether prefill attention runs as PyTorch's CPU flash attention: in float32 (on an AVX2 EPYC, 2 threads,
    12/4 heads of 64, 0.48-0.92x the time of row-blocked GEMMs for fresh prefills of 64-1,024 tokens, and
    the split calls 0.58-0.87x a gather and GEMMs for 64-512 rows over 2,000-3,500 cached tokens); in bf16 on
    a CPU with AMX tiles, where its GEMMs outrun the AVX512-BF16 tile kernel (a fresh 4 x 512-token prefill
    4.6 ms vs 14.3, 2 threads); and in bf16 where the tile kernel (`tiles`) does not run (AVX2: the split
    calls 0.23-0.57x a gather and masked SDPA for 32-256 rows over 1,000-4,000 cached tokens)."""
    if device.type != "cpu" or not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.cpu._is_amx_tile_supported()) or not tiles
    return dtype == torch.float32

def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, blocks: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """A context chunk's rows q (n, H, D) at positions start..start+n-1, with their own keys k, v (n, Hkv, D),
    after `start` cached tokens in `blocks` (int64). Two flash-attention calls, each returning its rows'
    log-sum-exp: the prefix, which every row sees whole (unmasked, so a KV head's query heads are rows of
    one call), and the chunk itself, causal; the outputs are then weighted by their shares of the total
    softmax mass. Returns (n, H, D)."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    kp, vp = gather_context(k_cache, blocks, start).unsqueeze(0), gather_context(v_cache, blocks, start).unsqueeze(0)
    qg = q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * n, head_dim)
    o1, lse1 = flash(qg, kp, vp, 0.0, False, scale=scale)  # (1, Hkv, g * n, D), (1, Hkv, g * n)
    own_k = k.transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0)  # (1, H, n, D)
    own_v = v.transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0)
    o2, lse2 = flash(q.transpose(0, 1).unsqueeze(0), own_k, own_v, 0.0, True, scale=scale)  # (1, H, n, D)
    lse1, lse2 = lse1.reshape(num_heads, n, 1), lse2.reshape(num_heads, n, 1)
    w1 = torch.sigmoid(lse1 - lse2)  # exp(lse1) / (exp(lse1) + exp(lse2))
    o = torch.lerp(o2.reshape(num_heads, n, head_dim).float(), o1.reshape(num_heads, n, head_dim).float(), w1)
    return o.transpose(0, 1).to(q.dtype)


def context_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                      ctx_len: int, scale: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's query rows (n, H, D), the last n positions of its first `ctx_len` cached tokens, which
    live in `blocks` (int64): the context gathered into (Hkv, ctx, D), then `causal_attention`."""
    ks, vs = gather_context(k_cache, blocks, ctx_len), gather_context(v_cache, blocks, ctx_len)
    return causal_attention(q, ks, vs, scale, mask)


def gather_context(cache: torch.Tensor, blocks: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """The first `ctx_len` tokens of a paged cache (NB, Hkv, BS, D) that `blocks` (int64) point at,
    gathered into (Hkv, ctx_len, D)."""
    num_kv_heads, head_dim = cache.shape[1], cache.shape[3]
    return cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :ctx_len]


def causal_attention(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, scale: float,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Query rows (n, H, D) that are the last n positions of the context `ks`, `vs` (Hkv, ctx, D), each
    seeing the context up to itself: SDPA under `mask` (`context_mask` of those positions, or its `mask_bias`
    in q's dtype, which a step builds once for all its layers; built here when not given). Returns (n, H, D)."""
    n, ctx_len = q.shape[0], ks.shape[1]
    if mask is None:
        mask = context_mask(ctx_len, torch.arange(ctx_len - n, ctx_len, device=q.device))
    o = F.scaled_dot_product_attention(q.transpose(0, 1), ks, vs, attn_mask=mask, scale=scale,
                                       enable_gqa=q.shape[1] != ks.shape[0])
    return o.transpose(0, 1)
