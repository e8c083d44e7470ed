"""Which attention code a chunk takes, from its position, length and what the runner can use."""

from __future__ import annotations

import pytest

from sessionserve.model.attention import (
    GATHER_MIN_ROWS,
    SPLIT_MIN_ROWS,
    TILE_MIN_ROWS,
    AttentionCaps,
    AttentionPath,
    attention_path,
)

FP32_CPU = AttentionCaps(flash=True, paged_kernel=True)
NO_FLASH = AttentionCaps(paged_kernel=True)  # a torch without the CPU flash op
BF16_TILES = AttentionCaps(tiles=True, paged_kernel=True)
BF16_AMX = AttentionCaps(tiles=True, flash=True, paged_kernel=True)
NO_KERNEL = AttentionCaps()  # no compiler: torch only

P = AttentionPath


@pytest.mark.parametrize("caps, start, rows, path", [
    (FP32_CPU, 0, 512, P.FRESH), (FP32_CPU, 0, 1, P.FRESH),
    (FP32_CPU, 700, 1, P.PAGED),  # decode
    (FP32_CPU, 700, SPLIT_MIN_ROWS - 1, P.PAGED), (FP32_CPU, 700, SPLIT_MIN_ROWS, P.CONTEXT_SPLIT),
    (NO_FLASH, 0, 512, P.FRESH),
    (NO_FLASH, 700, GATHER_MIN_ROWS - 1, P.PAGED), (NO_FLASH, 700, GATHER_MIN_ROWS, P.CONTEXT_GATHER),
    (BF16_TILES, 0, 512, P.FRESH_TILES),
    (BF16_TILES, 700, TILE_MIN_ROWS - 1, P.PAGED), (BF16_TILES, 700, TILE_MIN_ROWS, P.CONTEXT_TILES),
    (BF16_AMX, 0, 512, P.FRESH),  # flash attention on AMX beats the tiles for fresh chunks
    (BF16_AMX, 700, SPLIT_MIN_ROWS, P.CONTEXT_SPLIT), (BF16_AMX, 700, SPLIT_MIN_ROWS - 1, P.CONTEXT_TILES),
    (BF16_AMX, 700, 1, P.PAGED),
    (NO_KERNEL, 0, 64, P.FRESH), (NO_KERNEL, 700, GATHER_MIN_ROWS * 4, P.PAGED),  # the paged path's fallback
])
def test_attention_path(caps: AttentionCaps, start: int, rows: int, path: AttentionPath) -> None:
    assert attention_path(start, rows, caps) is path
