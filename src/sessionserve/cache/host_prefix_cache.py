"""A second level of the prefix cache in host memory: what the device evicts, kept by hash until it is needed.

The device's prefix cache forgets a cached block when the pool reuses it.
With this cache the pool hands the block over first (`BlockPool.on_evict`):
its data is copied into host memory under its hash, and a later request whose
prefix runs past the device-cached head gets it back (`load`, the KV
manager's `lower` tier) instead of computing it again. Under memory pressure
this is what makes preemption cheap: a preempted sequence's blocks stay in
the prefix cache, are evicted to here as others need the room, and come back
when it is admitted again; on a CPU host memory is the same RAM, so a block
moves in microseconds where recomputing it takes milliseconds.

Least recently used blocks leave when the budget is full. Engine thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from sessionserve.cache.block_pool import BlockPool
from sessionserve.cache.kv_layout import KVCaches, KVLayout, gather_blocks
from sessionserve.cache.kv_store_client import device_writer
from sessionserve.cache.lower_tier import load_blocks


@dataclass
class HostPrefixCacheStats:
    num_blocks_kept: int = 0  # device evictions copied here
    num_blocks_loaded: int = 0  # blocks brought back to the device
    num_blocks_dropped: int = 0  # blocks this cache let go for its budget


class HostPrefixCache:
    """Evicted device blocks by hash, in host memory, within `budget_bytes`."""

    def __init__(self, kv_caches: KVCaches, pool: BlockPool, budget_bytes: int) -> None:
        self.kv_caches = kv_caches
        self.pool = pool
        block_bytes = KVLayout.from_kv_caches(kv_caches).block_bytes
        self.max_blocks = budget_bytes // block_bytes
        if self.max_blocks < 1:
            raise ValueError(f"a host prefix cache of {budget_bytes} bytes holds no block of {block_bytes} bytes")
        self.pin = kv_caches[0][0].device.type == "cuda"
        self._write = device_writer(kv_caches)
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.stats = HostPrefixCacheStats()

    def __len__(self) -> int:
        return len(self._blocks)

    def keep(self, block: int, block_hash: bytes) -> None:
        """Copy device block `block` here under `block_hash` (the pool is about to reuse it)."""
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return
        data = gather_blocks(self.kv_caches, [block])[0]
        if data.device.type != "cpu":
            data = data.to("cpu", non_blocking=False)
            if self.pin:
                data = data.pin_memory()
        self._blocks[block_hash] = data
        self.stats.num_blocks_kept += 1
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
            self.stats.num_blocks_dropped += 1

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        data = self._blocks.get(block_hash)
        if data is not None:
            self._blocks.move_to_end(block_hash)
        return data

    def load(self, block_hashes: list[bytes]) -> int:
        """Bring the blocks after the device-cached head of `block_hashes` back from here. Returns how many."""
        n = len(load_blocks(self, self.pool, block_hashes, self._write))
        self.stats.num_blocks_loaded += n
        return n

    def clear(self) -> None:
        self._blocks.clear()
