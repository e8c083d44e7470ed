"""Trimming a block table when a client rewrites a session's history."""

from __future__ import annotations

from sessionserve.cache.kv_manager import KVCacheManager


def test_trim_frees_tail_blocks_and_keeps_a_private_partial_block() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate("s", 14)  # 4 blocks; last one partial (private)
    kv.commit_full_blocks("s", list(range(14)), 14)  # 3 full blocks in the index
    assert kv.trim("s", 13) == 13  # cut inside the private partial block: kept
    assert len(kv.block_tables["s"]) == 4
    assert kv.trim("s", 9) == 8  # cut inside a committed full block: it is dropped
    assert len(kv.block_tables["s"]) == 2
    assert kv.num_free_blocks == 6
    kv.check_integrity()


def test_trimmed_full_block_stays_shared_with_others() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(12))
    kv.allocate("a", 12)
    kv.commit_full_blocks("a", tokens, 12)
    hit = kv.find_cached_prefix("b", tokens + [99])
    kv.allocate("b", 13, hit)
    shared = kv.block_tables["b"][2]
    assert kv.trim("b", 10) == 8
    assert kv.pool.ref_counts[shared] == 1  # still a's
    kv.check_integrity()
