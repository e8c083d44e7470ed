"""The host prefix cache on the virtual clock: which blocks it holds, and what each copy costs in time.

Same bookkeeping as `cache.host_prefix_cache.HostPrefixCache` (`EvictedBlocks`:
the pool's eviction hook, the KV manager's lower tier); no data moves, and
every block copied either way advances the clock by its bytes over the
profile's host copy bandwidth, on the engine's thread as in the engine.
"""

from __future__ import annotations

from sessionserve.cache.block_pool import BlockPool
from sessionserve.cache.lower_tier import EvictedBlocks
from sessionserve.sim.clock import VirtualClock


class SimHostPrefixCache(EvictedBlocks):
    def __init__(self, pool: BlockPool, clock: VirtualClock, max_blocks: int, s_per_block: float) -> None:
        super().__init__(pool, max_blocks)
        self.clock = clock
        self.s_per_block = s_per_block

    def _copy_out(self, blocks: list[int]) -> list[bool]:
        self.clock.advance(len(blocks) * self.s_per_block)
        return [True] * len(blocks)

    def _write(self, blocks: list[int], datas: list[bool]) -> None:
        self.clock.advance(len(blocks) * self.s_per_block)
