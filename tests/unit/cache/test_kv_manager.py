"""KVCacheManager: block tables, prefix reuse and all-or-nothing allocation."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

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


def _fresh_run(kv: KVCacheManager, token_ids: list[int]) -> list[int]:
    """The longest cached run of `token_ids`'s reusable blocks, walked from the start."""
    blocks = []
    for block_hash in kv.block_hashes(token_ids)[:(len(token_ids) - 1) // kv.block_size]:
        block = kv.pool.lookup(block_hash)
        if block is None:
            break
        blocks.append(block)
    return blocks


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["run", "ask", "evict", "reset"]), st.integers(0, 5),
                          st.integers(1, 12)), min_size=1, max_size=40))
def test_a_waiting_requests_cached_run_is_always_what_a_fresh_walk_finds(ops) -> None:
    """Asked again and again while it waits (the memo: only blocks evicted since, and lookups past the end),
    a request gets exactly the run a walk from the start finds, whatever ran, finished or was evicted between."""
    kv = KVCacheManager(num_blocks=24, block_size=4)
    # Six prompts sharing heads of different lengths: runs grow, shrink and fork as others come and go.
    prompts = [[7] * 8 + [p % 3] * 12 + [p] * 20 for p in range(6)]
    waiting = {f"w{i}": prompts[i][:8 + 4 * i + 9] for i in range(3)}
    done = 0
    for op, which, size in ops:
        if op == "run":  # another request computes a prompt's head and finishes; its blocks stay cached
            tokens = prompts[which][:4 * size + 1]
            rid = f"r{done}"
            done += 1
            hit = kv.find_cached_prefix(rid, tokens)
            if kv.allocate(rid, len(tokens), hit) is not None:
                kv.commit_full_blocks(rid, tokens, len(tokens))
            kv.free(rid)
        elif op == "evict":  # a request takes blocks, evicting the least recently freed cached ones
            rid = f"e{done}"
            done += 1
            if kv.allocate(rid, 4 * min(size, kv.num_free_blocks)) is not None:
                kv.free(rid)
        elif op == "reset":
            kv.pool.reset_prefix_cache()
        for rid, tokens in waiting.items():
            if op == "ask" or rid == f"w{which % 3}":
                assert kv.find_cached_prefix(rid, tokens).blocks == _fresh_run(kv, tokens)
        kv.check_integrity()
    for rid, tokens in waiting.items():
        assert kv.find_cached_prefix(rid, tokens).blocks == _fresh_run(kv, tokens)
        kv.free(rid)
    assert not kv._memo
