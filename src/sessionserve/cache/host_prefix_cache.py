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

import torch

from sessionserve.cache.block_pool import BlockPool
from sessionserve.cache.kv_layout import KVCaches, KVLayout, gather_blocks
from sessionserve.cache.kv_store_client import device_writer
from sessionserve.cache.lower_tier import EvictedBlocks


class HostPrefixCache(EvictedBlocks):
    """Evicted device blocks by hash, in host memory, within `budget_bytes`."""

    def __init__(self, kv_caches: KVCaches, pool: BlockPool, budget_bytes: int) -> None:
        block_bytes = KVLayout.from_kv_caches(kv_caches).block_bytes
        if budget_bytes < block_bytes:
            raise ValueError(f"a host prefix cache of {budget_bytes} bytes holds no block of {block_bytes} bytes")
        super().__init__(pool, budget_bytes // block_bytes)
        self.kv_caches = kv_caches
        self.pin = kv_caches[0][0].device.type == "cuda"
        self._write = device_writer(kv_caches)  # type: ignore[method-assign]

    def _copy_out(self, blocks: list[int]) -> list[torch.Tensor]:
        # One gather for all of them, then a block-sized copy each: a row kept as a view would hold the
        # whole group's memory until its last row leaves.
        group = gather_blocks(self.kv_caches, blocks)
        if group.device.type != "cpu":
            group = group.to("cpu")
        rows = [row.clone() for row in group]
        return [row.pin_memory() for row in rows] if self.pin else rows

    def clear(self) -> None:
        self._blocks.clear()
