"""BlockPool: allocation, reference counts, the prefix index and LRU eviction."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessionserve.cache.block_pool import BlockPool


def test_allocate_and_free_return_to_empty() -> None:
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert sorted(a + b) == list(range(8))
    assert pool.num_free_blocks == 0
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.free(a)
    pool.free(b)
    assert pool.num_free_blocks == 8
    pool.check_integrity()


def test_shared_blocks_are_counted_while_more_than_one_reads_them() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.touch(a)  # a second reader (a fork, a prefix hit)
    pool.touch(a[:1])  # and a third on the first block
    assert pool.num_shared_blocks == 2
    pool.free(a)
    assert pool.num_shared_blocks == 1
    pool.free(a[:1])
    assert pool.num_shared_blocks == 0
    pool.free(a)
    pool.check_integrity()


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    a = pool.allocate(1)
    pool.free(a)
    with pytest.raises(RuntimeError):
        pool.free(a)


def test_cached_block_survives_free_and_is_reused() -> None:
    pool = BlockPool(4)
    [blk] = pool.allocate(1)
    assert pool.cache_block(blk, b"h1")
    pool.free([blk])
    assert pool.lookup(b"h1") == blk
    assert pool.num_free_blocks == 4  # evictable counts as free
    pool.touch([blk])
    assert pool.ref_counts[blk] == 1 and pool.num_free_blocks == 3
    pool.free([blk])
    pool.check_integrity()


def test_uncached_blocks_are_used_before_evicting_cached_ones() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.cache_block(blocks[0], b"a")
    pool.free(blocks)
    got = pool.allocate(2)
    assert blocks[0] not in got
    assert pool.lookup(b"a") == blocks[0]
    got += pool.allocate(1)  # now the cached one must be evicted
    assert pool.lookup(b"a") is None
    assert pool.num_evicted_blocks == 1
    pool.check_integrity()


def test_eviction_is_least_recently_freed_first() -> None:
    pool = BlockPool(2)
    x, y = pool.allocate(2)
    pool.cache_block(x, b"x")
    pool.cache_block(y, b"y")
    pool.free([y])
    pool.free([x])  # x freed last: most recent
    pool.allocate(1)
    assert pool.lookup(b"y") is None and pool.lookup(b"x") == x


def test_duplicate_hash_is_not_registered_twice() -> None:
    pool = BlockPool(2)
    x, y = pool.allocate(2)
    assert pool.cache_block(x, b"same")
    assert not pool.cache_block(y, b"same")
    pool.free([x, y])
    pool.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "touch"]), st.integers(0, 7)), max_size=80))
def test_random_operations_keep_invariants(ops: list[tuple[str, int]]) -> None:
    pool = BlockPool(8)
    held: list[int] = []
    for op, arg in ops:
        if op == "alloc" and pool.can_allocate(arg % 3 + 1):
            held += pool.allocate(arg % 3 + 1)
        elif op == "free" and held:
            pool.free([held.pop(arg % len(held))])
        elif op == "cache" and held:
            pool.cache_block(held[arg % len(held)], bytes([arg]))
        elif op == "touch":
            blk = pool.lookup(bytes([arg]))
            if blk is not None:
                pool.touch([blk])
                held.append(blk)
        pool.check_integrity()
    pool.free(held)
    pool.check_integrity()
    assert pool.num_free_blocks == 8


def test_on_evict_sees_each_cached_block_before_its_reuse() -> None:
    pool = BlockPool(3)
    seen: list[tuple[int, bytes, bool]] = []
    pool.on_evict = lambda evicted: seen.extend((block, h, pool._hash_of[block] is None) for block, h in evicted)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, b"ha")
    pool.cache_block(b, b"hb")
    pool.free([a, b, c])  # c was never cached: reused without a call
    pool.allocate(2)
    assert seen == [(b, b"hb", True)] or seen == [(a, b"ha", True)]  # the LRU cached block, out of the index, not yet written
    assert len(seen) == 1


def test_the_log_of_uncached_blocks_answers_until_it_is_trimmed() -> None:
    pool = BlockPool(2)
    mark = pool.uncache_mark()
    assert pool.uncached_since(mark) == []
    blocks = pool.allocate(2)
    for i, block in enumerate(blocks):
        pool.cache_block(block, bytes([i]))
    pool.free(blocks)
    pool.allocate(1)  # evicts the least recently freed cached block
    assert len(pool.uncached_since(mark)) == 1
    for i in range(2000):  # far past what the log keeps for 2 blocks
        block = pool.allocate(1)[0]
        pool.cache_block(block, i.to_bytes(4, "big"))
        pool.free([block])
    assert pool.uncached_since(mark) is None
    assert pool.uncached_since(pool.uncache_mark()) == []
