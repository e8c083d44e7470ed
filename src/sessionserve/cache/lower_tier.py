"""Loading a prompt's blocks from a tier below the device's prefix cache: the bookkeeping every such tier shares.

Torch-free: the data is moved by the caller's `write` (device copies in the
engine, clock time in the simulator).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from sessionserve.cache.block_pool import BlockPool


class BlockSource(Protocol):
    def contains(self, block_hash: bytes) -> bool: ...

    def get(self, block_hash: bytes) -> Any: ...


def load_blocks(source: BlockSource, pool: BlockPool, block_hashes: list[bytes],
                write: Callable[[list[int], list[Any]], None]) -> list[bytes]:
    """Bring the blocks that follow the device-cached head of `block_hashes` in from `source`.

    `block_hashes`: the full blocks of a prompt that may be reused (not the last token's block). Stops at
    the first block `source` lacks (`get` returns None), and at the device's free blocks (evicting cached
    ones, LRU, as an allocation does). `write(blocks, datas)` puts what `get` returned into the allocated
    device blocks. The loaded blocks are registered in the prefix cache, unreferenced: the request's
    admission adopts them; if memory runs short first they are evicted like any cached block. The
    device-cached head is held while loading, so the allocation cannot evict it. Returns the loaded hashes.
    """
    held = []
    for h in block_hashes:
        block = pool.lookup(h)
        if block is None:
            break
        held.append(block)
    start = len(held)
    if start == len(block_hashes) or not source.contains(block_hashes[start]):
        return []
    pool.touch(held)
    try:
        hashes, datas = [], []
        for h in block_hashes[start:start + pool.num_free_blocks]:
            data = source.get(h)
            if data is None:
                break
            hashes.append(h)
            datas.append(data)
        if not hashes:
            return []
        blocks = pool.allocate(len(hashes))
        try:
            write(blocks, datas)
            for block, h in zip(blocks, hashes):
                pool.cache_block(block, h)
        finally:
            pool.free(blocks)
    finally:
        pool.free(held)
    return hashes
