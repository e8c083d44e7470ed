"""Tiers below the device's prefix cache: the bookkeeping they share.

`load_blocks` brings a prompt's blocks in from any of them; `EvictedBlocks`
is the host prefix cache's index (what the device evicted, by hash, least
recently used first). Torch-free: data moves in the subclass or the caller's
`write` (device copies in the engine, clock time in the simulator).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass
class EvictedBlocksStats:
    num_blocks_kept: int = 0  # device evictions copied here
    num_blocks_loaded: int = 0  # blocks brought back to the device
    num_blocks_dropped: int = 0  # blocks let go for the budget


class EvictedBlocks:
    """Blocks the device's prefix cache evicted, by hash, at most `max_blocks`, least recently used first.

    `keep` is the pool's eviction hook (`BlockPool.on_evict`), `load` the KV manager's lower tier.
    Subclasses move the data: `_copy_out(blocks)` returns, per block, what `get` will give back for it,
    and `_write(blocks, datas)` puts such data into device blocks.
    """

    def __init__(self, pool: BlockPool, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError("a host prefix cache must hold at least one block")
        self.pool = pool
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, Any] = OrderedDict()
        self.stats = EvictedBlocksStats()

    def __len__(self) -> int:
        return len(self._blocks)

    def keep(self, evicted: list[tuple[int, bytes]]) -> None:
        """Copy the evicted device blocks here under their hashes (the pool is about to reuse them)."""
        new = []
        for block, block_hash in evicted:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
            else:
                new.append((block, block_hash))
        if not new:
            return
        for (_, block_hash), data in zip(new, self._copy_out([b for b, _ in new])):
            self._blocks[block_hash] = data
        self.stats.num_blocks_kept += len(new)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
            self.stats.num_blocks_dropped += 1

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def get(self, block_hash: bytes) -> Any:
        data = self._blocks.get(block_hash)
        if data is not None:
            self._blocks.move_to_end(block_hash)
        return data

    def load(self, block_hashes: list[bytes]) -> int:
        """Bring the blocks after the device-cached head of `block_hashes` back from here. Returns how many."""
        n = len(load_blocks(self, self.pool, block_hashes, self._write))
        self.stats.num_blocks_loaded += n
        return n

    def _copy_out(self, blocks: list[int]) -> list[Any]:
        raise NotImplementedError

    def _write(self, blocks: list[int], datas: list[Any]) -> None:
        raise NotImplementedError
