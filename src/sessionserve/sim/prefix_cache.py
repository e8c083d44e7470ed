"""The host prefix cache on the virtual clock: which blocks it holds, and what each copy costs in time.

Same bookkeeping as `cache.host_prefix_cache.HostPrefixCache` (the pool's
eviction hook, the KV manager's lower tier, `load_blocks`); no data moves, and
every block copied either way advances the clock by its bytes over the
profile's host copy bandwidth, on the engine's thread as in the engine.
"""

from __future__ import annotations

from collections import OrderedDict

from sessionserve.cache.block_pool import BlockPool
from sessionserve.cache.lower_tier import load_blocks
from sessionserve.sim.clock import VirtualClock


class SimHostPrefixCache:
    def __init__(self, pool: BlockPool, clock: VirtualClock, max_blocks: int, s_per_block: float) -> None:
        if max_blocks < 1:
            raise ValueError("a host prefix cache must hold at least one block")
        self.pool = pool
        self.clock = clock
        self.max_blocks = max_blocks
        self.s_per_block = s_per_block
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.num_blocks_kept = self.num_blocks_loaded = self.num_blocks_dropped = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def keep(self, block: int, block_hash: bytes) -> None:
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return
        self.clock.advance(self.s_per_block)
        self._blocks[block_hash] = None
        self.num_blocks_kept += 1
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
            self.num_blocks_dropped += 1

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def get(self, block_hash: bytes) -> bool | None:
        if block_hash not in self._blocks:
            return None
        self._blocks.move_to_end(block_hash)
        return True

    def load(self, block_hashes: list[bytes]) -> int:
        n = len(load_blocks(self, self.pool, block_hashes, self._write))
        self.num_blocks_loaded += n
        return n

    def _write(self, blocks: list[int], _datas: list[bool]) -> None:
        self.clock.advance(len(blocks) * self.s_per_block)
