"""KVCacheManager: block tables, prefix reuse and all-or-nothing allocation."""

from __future__ import annotations

from sessionserve.cache.block_hash import extend_block_hashes, hash_block
from sessionserve.cache.kv_manager import KVCacheManager


def test_hashes_are_chained_and_salted() -> None:
    a = extend_block_hashes([], list(range(8)), 4)
    b = extend_block_hashes([], [0, 1, 2, 3, 9, 9, 9, 9], 4)
    assert a[0] == b[0] and a[1] != b[1]
    assert extend_block_hashes([], list(range(8)), 4, salt=b"t1")[0] != a[0]
    # A block's hash depends on its parent: same tokens after a different prefix differ.
    assert hash_block(a[0], [4, 5, 6, 7]) != hash_block(hash_block(None, [9, 9, 9, 9]), [4, 5, 6, 7])
    assert len(extend_block_hashes([], list(range(7)), 4)) == 1  # partial blocks are not hashed


def test_prefix_hit_reuses_blocks_and_leaves_one_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(12))
    assert kv.allocate("a", len(tokens)) is not None
    kv.commit_full_blocks("a", tokens, num_computed_tokens=12)
    hit = kv.find_cached_prefix("b", tokens)
    # 12 tokens = 3 full blocks, but one token must be left to compute: 2 blocks.
    assert hit.num_tokens == 8 and hit.blocks == kv.block_tables["a"][:2]
    assert kv.allocate("b", 12, hit) is not None
    assert kv.block_tables["b"][:2] == kv.block_tables["a"][:2]
    assert kv.pool.ref_counts[kv.block_tables["a"][0]] == 2
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 16
    kv.check_integrity()


def test_allocation_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate("a", 12) is not None  # 3 blocks
    assert kv.allocate("b", 8) is None  # needs 2, 1 free
    assert "b" not in kv.block_tables
    assert kv.num_free_blocks == 1
    kv.check_integrity()


def test_reviving_an_evictable_hit_counts_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    tokens = list(range(9))
    kv.allocate("a", 9)
    kv.commit_full_blocks("a", tokens, 9)
    kv.free("a")  # 2 cached evictable blocks + 1 free
    hit = kv.find_cached_prefix("b", tokens)
    assert hit.num_tokens == 8
    # b needs 3 blocks: 2 revived + 1 new = all 3 free ones.
    assert kv.allocate("b", 9, hit) is not None
    assert kv.num_free_blocks == 0
    kv.check_integrity()


def test_prefix_caching_off() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    kv.allocate("a", 8)
    kv.commit_full_blocks("a", list(range(8)), 8)
    assert kv.find_cached_prefix("b", list(range(8))).num_tokens == 0


def test_blocks_freed_with_their_hashes_kept_are_committed_again_without_rehashing(monkeypatch) -> None:
    """A session's KV leaves the device for another tier and comes back: its tokens have not changed, so
    the block hashes computed before serve again (a long context would otherwise be rehashed per restore)."""
    import sessionserve.cache.block_hash as block_hash

    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(100, 118))  # 4 full blocks and a partial one
    kv.allocate("session:a", len(tokens))
    kv.commit_full_blocks("session:a", tokens, len(tokens))
    before = [kv.pool.lookup(h) for h in kv._hashes["session:a"]]
    kv.free("session:a", keep_hashes=True)
    calls = []
    real = block_hash.hash_block
    monkeypatch.setattr(block_hash, "hash_block", lambda *a: calls.append(a) or real(*a))
    kv.pool.reset_prefix_cache()  # evicted meanwhile: the restore must register the blocks again
    assert all(kv.pool.lookup(h) is None for h in kv._hashes["session:a"])
    kv.allocate("session:a", len(tokens))
    kv.commit_full_blocks("session:a", tokens, len(tokens))
    assert calls == []
    assert [kv.pool.lookup(h) for h in kv._hashes["session:a"]] == kv.block_tables["session:a"][:4]
    assert len(before) == 4
    kv.free("session:a")  # the default forgets them
    assert "session:a" not in kv._hashes
    kv.check_integrity()
