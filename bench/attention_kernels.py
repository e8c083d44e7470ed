"""The CPU attention kernels alone: bf16 prefill tiles vs SDPA and vs the paged kernel on context chunks; float32
and bfloat16 decode through the paged kernel; and fp32 context chunks through the paged kernel vs the split
flash attention vs a gather of the context and SDPA under a mask.

    .venv/bin/python bench/attention_kernels.py [--threads 2] [--repeats 5]

Fresh prefill: `--seqs` sequences of `--len` tokens, causal, through
`tile_attention` and through PyTorch's fused SDPA (what the engine uses
without tiles). Context chunks: one sequence with `ctx` cached tokens in a
scattered block table and `rows` new query tokens, through the paged kernel
and through the tiles; this is what `attention.TILE_MIN_ROWS` is chosen
from. Both bf16 tables also time PyTorch's CPU flash attention, which is what
the engine takes instead of the tiles on CPUs with AMX: for fresh prefills it
is the fused SDPA row, for context chunks `attention.split_attention` (one call
over the cached prefix, one causal call over the chunk, merged by log-sum-exp;
from `attention.SPLIT_MIN_ROWS` rows). In float32 (no tiles, flash
attention everywhere the op exists): the context chunks through the paged
kernel, the split flash calls and the gather + masked SDPA path (what runs
where there is no flash op): where `attention.SPLIT_MIN_ROWS` comes from.
The bf16 tables need the AVX512-BF16 kernel; the fp32 one runs anywhere.
Random inputs, median of `--repeats` timed calls after one warm-up.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from bench.timing import timed_ms
from sessionserve.model import paged_kernel, tile_attention
from sessionserve.model.attention import context_attention, split_attention, uses_flash_attention


def ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seqs", type=int, default=4, help="fresh prefill: sequences")
    p.add_argument("--len", type=int, default=512, help="fresh prefill: tokens per sequence")
    p.add_argument("--layers", type=int, default=12, help="decode from memory: layers, each with its own caches")
    p.add_argument("--decode-only", action="store_true", help="only the decode tables")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    H, Hkv, D, BS = a.heads, a.kv_heads, a.head_dim, a.block_size
    bf16 = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    scale = D ** -0.5
    if not paged_kernel.available():  # loads (or builds) the C++ kernels
        raise SystemExit("no paged attention kernel on this machine/build")

    for dtype in (torch.float32, bf16):
        name = str(dtype).removeprefix("torch.")
        print(f"{name} decode, scattered blocks, {H}/{Hkv} heads of {D}, block size {BS}, {a.threads} threads; "
              f"from memory: one call per layer of {a.layers}, each layer's caches its own")
        print("| sequences | context | in cache ms | GB/s | from memory ms | GB/s |\n|---|---|---|---|---|---|")
        for seqs, ctx in ((1, 2000), (2, 2000), (8, 2000), (8, 4000), (32, 1000)):
            gb = seqs * ctx * Hkv * D * dtype.itemsize * 2 / 1e6
            hot = decode(seqs, ctx, H, Hkv, D, BS, dtype, g, a.repeats)
            cold = decode(seqs, ctx, H, Hkv, D, BS, dtype, g, a.repeats, layers=a.layers)
            print(f"| {seqs} | {ctx} | {hot:.3f} | {gb / hot:.1f} | {cold:.3f} | {gb / cold:.1f} |")
        print()
    if a.decode_only:
        return

    print(f"float32 context chunks, one sequence, {H}/{Hkv} heads of {D}, block size {BS}, {a.threads} threads")
    print("| cached tokens | new rows | paged kernel ms | split flash ms | gather + masked SDPA ms | paged / split |"
          "\n|---|---|---|---|---|---|")
    for ctx in (256, 1024, 4096):
        for rows in (8, 16, 32, 64, 256):
            paged, split, gather = context_chunk_fp32(ctx, rows, H, Hkv, D, BS, g, a.repeats)
            print(f"| {ctx} | {rows} | {paged:.2f} | {split:.2f} | {gather:.2f} | {paged / split:.2f}x |")
    print()
    if not tile_attention.available():
        raise SystemExit("no AVX512-BF16 tile kernel on this machine/build: bf16 tables skipped")

    n, L = a.seqs, a.len
    q = torch.randn(n * L, H, D, generator=g).to(bf16)
    k = torch.randn(n * L, Hkv, D, generator=g).to(bf16)
    v = torch.randn(n * L, Hkv, D, generator=g).to(bf16)
    out = torch.empty_like(q)
    starts, lens, zeros = ints([i * L for i in range(n)]), ints([L] * n), ints([0] * n)
    qs, ks, vs = (x.view(n, L, -1, D).transpose(1, 2) for x in (q, k, v))
    tiles = timed_ms(lambda: tile_attention.tile_attention_(out, q, k, v, starts, lens, zeros, None, scale), a.repeats)
    sdpa = timed_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True),
                    a.repeats)
    amx = "AMX: the engine takes flash attention" if uses_flash_attention(torch.device("cpu"), bf16) else "no AMX"
    print(f"fresh prefill, {n} x {L} tokens, {H}/{Hkv} heads of {D}, {a.threads} threads ({amx})")
    print("| kernel | ms | vs SDPA |\n|---|---|---|")
    print(f"| SDPA (fused, causal: CPU flash attention) | {sdpa:.2f} | 1.00x |\n"
          f"| tiles | {tiles:.2f} | {sdpa / tiles:.2f}x |\n")

    print(f"context chunks, one sequence, block size {BS}")
    print("| cached tokens | new rows | paged kernel ms | tiles ms | split flash ms | paged / tiles | split / tiles |\n"
          "|---|---|---|---|---|---|---|")
    for ctx in (500, 4000, 16000):
        for rows in (16, 64, 256):
            paged, tile, split = context_chunk(ctx, rows, H, Hkv, D, BS, g, a.repeats)
            print(f"| {ctx} | {rows} | {paged:.2f} | {tile:.2f} | {split:.2f} | {paged / tile:.2f}x "
                  f"| {split / tile:.2f}x |")


def decode(seqs: int, ctx: int, H: int, Hkv: int, D: int, BS: int, dtype: torch.dtype, g: torch.Generator,
           repeats: int, layers: int = 1) -> float:
    """ms of the paged kernel for one decode query per sequence over `ctx` cached tokens in scattered blocks.

    With `layers` > 1, one call per layer, each over its own caches (as a model's decode step reads them: the
    KV of a layer is no longer in cache when the next step comes back to it); the time is per call."""
    nb = -(-ctx // BS)
    pool = 2 * seqs * nb + 4  # the sequences' blocks scattered over twice their number
    caches = [tuple(torch.randn(pool, Hkv, BS, D, generator=g).to(dtype) for _ in range(2)) for _ in range(layers)]
    tables = torch.randperm(pool, generator=g)[:seqs * nb].view(seqs, nb).to(torch.int32)
    q = torch.randn(seqs, H, D, generator=g).to(dtype)
    seq, pos = torch.arange(seqs, dtype=torch.int32), torch.full((seqs,), ctx - 1, dtype=torch.int32)
    return timed_ms(lambda: [paged_kernel.paged_attention(q, k, v, tables, seq, pos, D ** -0.5) for k, v in caches],
                    repeats) / layers


def context_chunk_fp32(ctx: int, rows: int, H: int, Hkv: int, D: int, BS: int, g: torch.Generator,
                       repeats: int) -> tuple[float, float, float]:
    """ms of the paged kernel, the split flash calls and gather + masked SDPA for `rows` new fp32 tokens over
    `ctx` cached ones."""
    scale, total = D ** -0.5, ctx + rows
    nb = -(-total // BS)
    k_cache = torch.randn(nb + 4, Hkv, BS, D, generator=g)
    v_cache = torch.randn(nb + 4, Hkv, BS, D, generator=g)
    table = torch.randperm(nb + 4, generator=g)[:nb].view(1, nb).to(torch.int32)
    q = torch.randn(rows, H, D, generator=g)
    seq, pos = torch.zeros(rows, dtype=torch.int32), torch.arange(ctx, total, dtype=torch.int32)
    paged = timed_ms(lambda: paged_kernel.paged_attention(q, k_cache, v_cache, table, seq, pos, scale), repeats)
    blocks = table[0].long()
    own_k, own_v = (torch.randn(rows, Hkv, D, generator=g) for _ in range(2))
    prefix = blocks[:-(-ctx // BS)]
    split = timed_ms(lambda: split_attention(q, own_k, own_v, k_cache, v_cache, prefix, ctx, scale), repeats)
    gather = timed_ms(lambda: context_attention(q, k_cache, v_cache, blocks, total, scale), repeats)
    return paged, split, gather


def context_chunk(ctx: int, rows: int, H: int, Hkv: int, D: int, BS: int, g: torch.Generator,
                  repeats: int) -> tuple[float, float, float]:
    """ms of the paged kernel, the tiles and the split flash calls for `rows` new tokens over `ctx` cached ones."""
    bf16, scale, total = torch.bfloat16, D ** -0.5, ctx + rows
    nb = -(-total // BS)
    k_cache = torch.randn(nb + 4, Hkv, BS, D, generator=g).to(bf16)
    v_cache = torch.randn(nb + 4, Hkv, BS, D, generator=g).to(bf16)
    table = torch.randperm(nb + 4, generator=g)[:nb].view(1, nb).to(torch.int32)
    q = torch.randn(rows, H, D, generator=g).to(bf16)
    out = torch.empty_like(q)
    seq, pos = torch.zeros(rows, dtype=torch.int32), torch.arange(ctx, total, dtype=torch.int32)
    paged = timed_ms(lambda: paged_kernel.paged_attention(q, k_cache, v_cache, table, seq, pos, scale), repeats)
    tile = timed_ms(lambda: tile_attention.tile_attention_(out, q, k_cache, v_cache, ints([0]), ints([rows]),
                                                           ints([ctx]), table, scale), repeats)
    own_k, own_v = (torch.randn(rows, Hkv, D, generator=g).to(bf16) for _ in range(2))
    blocks = table[0, :-(-ctx // BS)].long()
    split = timed_ms(lambda: split_attention(q, own_k, own_v, k_cache, v_cache, blocks, ctx, scale), repeats)
    return paged, tile, split

if __name__ == "__main__":
    main()
