"""Causal attention for prefill chunks in bfloat16 on CPUs with AVX512-BF16: query tiles.

Prefill attention is compute-bound: a chunk of n tokens costs about 2 n^2 D
FLOPs per head. PyTorch's CPU flash attention runs it at ~70 GFLOPS here
(two cores), while the same products as bf16 GEMMs run at ~350; the
difference is in how the tiles are multiplied and how often the scores go
through memory. This kernel takes a tile of query tokens of one sequence and
all query heads that share a KV head (GQA: the keys are read once for the
group), and walks the keys in blocks of 64:

  - the key block is repacked into pairs of bf16 (VNNI order), and the
    scores S = Q K^T come out of `vdpbf16ps` (bf16 products summed into
    float32), a 4 x 4 register tile of rows x 16-key columns at a time;
  - the causal mask, the online softmax (running max and sum per row) and
    the conversion of the probabilities to bf16 happen on that S while it is
    in L1;
  - O += P V is again `vdpbf16ps`, with the value block repacked the same
    way, into a float32 accumulator that stays in the task's buffer.

Keys come either from the chunk's own K/V rows (a fresh prefill) or from
the paged cache through a block table (a chunk after a prefix-cache hit or an
earlier chunk), so both kinds of prefill take this path; decode tokens keep
the paged kernel. Scores and sums are float32 throughout; only P is rounded
to bf16 before it multiplies V, as in the flash-attention kernels of
PyTorch and oneDNN.

The C++ is `kernels/tile_attention.cpp`, compiled into the same extension as
the paged kernel; `available()` is False where the compiler does not target
AVX512-BF16, and attention then uses SDPA.
"""

from __future__ import annotations

import torch


def available() -> bool:
    """Whether the extension loaded with AVX512-BF16 tiles."""
    from sessionserve.model import paged_kernel

    return paged_kernel.available() and bool(torch.ops.sessionserve_kernels.tile_attention_available())


def supports_shape(head_dim: int) -> bool:
    """Whether the kernel handles this head size (pairs of 16-lane vectors, at most 256)."""
    return head_dim % 32 == 0 and head_dim <= 256


def tile_attention_(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: torch.Tensor,
                    q_len: torch.Tensor, pos0: torch.Tensor, block_tables: torch.Tensor | None,
                    scale: float) -> None:
    """Write causal attention of the sequences' query rows into `out` (T, H, D).

    Sequence s owns rows [q_start[s], q_start[s] + q_len[s]) of q; its first
    query is at position pos0[s]. Without `block_tables`, k/v are the batch's
    own (T, Hkv, D) rows (fresh prefills, pos0 = 0); with it, the paged
    caches (NB, Hkv, BS, D).
    """
    tables = block_tables if block_tables is not None else torch.empty(0, dtype=torch.int32)
    torch.ops.sessionserve_kernels.tile_attention_(out, q, k, v, q_start, q_len, pos0, tables, scale)
