"""Per-request block tables on top of the block pool, with prefix-cache reuse.

The manager knows requests only by id and token lists passed in; it has no
idea what a sequence or a session is. Callers follow the ask/act pattern:
`find_cached_prefix` (read-only), then `allocate` (all or nothing), then
`commit_full_blocks` once the step computed the tokens, and `free` at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from sessionserve.cache.block_hash import extend_block_hashes
from sessionserve.cache.block_pool import BlockPool
from sessionserve.types.sequence import BlockOwner


class PrefixHit(NamedTuple):
    blocks: list[int]  # cached blocks covering the first num_tokens tokens
    num_tokens: int


class _PrefixMemo:
    """A waiting request's cached run so far: valid while none of its blocks has left the index."""

    __slots__ = ("blocks", "mark", "members")

    def __init__(self, mark: int) -> None:
        self.mark = mark
        self.blocks: list[int] = []
        self.members: set[int] = set()


class KVCacheManager:
    """Block tables for live requests. All methods are O(blocks touched)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[BlockOwner, list[int]] = {}
        self._hashes: dict[BlockOwner, list[bytes]] = {}
        self._num_committed: dict[BlockOwner, int] = {}  # blocks of the request already in the prefix index
        # Requests without a table yet (waiting): their last cached run, so that asking again each step costs
        # the blocks evicted since and the lookups past the run's end, not a walk over the whole context.
        self._memo: dict[str, _PrefixMemo] = {}
        # A tier below the device's prefix cache (host memory, a shared folder): given the hashes of a prompt's
        # reusable blocks, it brings those after the device-cached head into the pool as cached, unreferenced
        # blocks and returns how many. None: the device cache is all there is.
        self.lower: Callable[[list[bytes]], int] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request_id: str, token_ids: Sequence[int], salt: bytes = b"") -> PrefixHit:
        """Longest run of cached full blocks at the start of `token_ids`. Changes no reference counts.

        At least one token is always left to compute, since the step that
        computes it produces the logits for the next token. With a `lower`
        tier, blocks past the device-cached head are first brought in from it
        (cached and unreferenced, like blocks a finished request left), if the
        request would fit in the free blocks whole.
        """
        if not self.enable_prefix_caching:
            return PrefixHit([], 0)
        hashes = extend_block_hashes(self._hashes.setdefault(request_id, []), token_ids, self.block_size, salt)
        reusable = hashes[:(len(token_ids) - 1) // self.block_size]
        blocks = self._cached_run(request_id, reusable)
        # Only when the whole request would fit: loading for one that then waits would evict other cached
        # blocks (to be loaded back for them in turn) at every step it waits.
        if len(blocks) < len(reusable) and self.lower is not None \
                and self.pool.num_free_blocks >= self.blocks_needed(len(token_ids) + 1) \
                and self.lower(reusable):
            blocks = self._cached_run(request_id, reusable)
        return PrefixHit(blocks, len(blocks) * self.block_size)

    def _cached_run(self, request_id: str, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest indexed prefix of `hashes`. A request with a table asks afresh;
        one without continues from its memo when no block of it has left the index since (chained hashes:
        a block still indexed still holds the same prefix, and new entries can only lengthen the run)."""
        pool = self.pool
        if request_id in self.block_tables:
            memo = _PrefixMemo(pool.uncache_mark())
        else:
            memo = self._memo.get(request_id)  # type: ignore[assignment]
            gone = None if memo is None else pool.uncached_since(memo.mark)
            if gone is None or len(memo.blocks) > len(hashes) or not memo.members.isdisjoint(gone):
                memo = self._memo[request_id] = _PrefixMemo(pool.uncache_mark())
            else:
                memo.mark = pool.uncache_mark()
        blocks, members = memo.blocks, memo.members
        for block_hash in hashes[len(blocks):]:
            block = pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
            members.add(block)
        return list(blocks)

    def block_hashes(self, token_ids: Sequence[int], salt: bytes = b"") -> list[bytes]:
        """Hashes of the full blocks of `token_ids` (chained, salted: the prefix cache's keys)."""
        return extend_block_hashes([], token_ids, self.block_size, salt)

    def known_block_hashes(self, key: BlockOwner, num_tokens: int) -> list[bytes] | None:
        """The hashes of the full blocks of `key`'s first `num_tokens` tokens if already worked out (as the
        prefix cache keys them), else None."""
        hashes = self._hashes.get(key)
        num_full = num_tokens // self.block_size
        return hashes[:num_full] if hashes is not None and len(hashes) >= num_full else None

    def computes_block(self, request_id: str, index: int, block_hash: bytes) -> bool:
        """True if `request_id` holds KV whose block `index` will hold `block_hash` once computed (an
        identical prefix, chained hashes, being prefilled by that request and not in the index yet)."""
        hashes = self._hashes.get(request_id)
        return (hashes is not None and request_id in self.block_tables
                and self._num_committed.get(request_id, 0) <= index < len(hashes) and hashes[index] == block_hash)

    def block_hash(self, request_id: str, index: int) -> bytes | None:
        """The hash of full block `index` of the tokens last passed for `request_id`, if known."""
        hashes = self._hashes.get(request_id)
        return hashes[index] if hashes is not None and index < len(hashes) else None

    def num_blocks_required(self, request_id: BlockOwner, num_total_tokens: int, hit: PrefixHit | None = None) -> int:
        """Free blocks `allocate` would consume for this call (new ones plus revived cached ones)."""
        table = self.block_tables.get(request_id)
        adopt = hit.blocks if hit is not None and table is None else []
        have = len(table) if table is not None else len(adopt)
        num_revived = sum(1 for b in adopt if self.pool.ref_counts[b] == 0)
        return max(0, self.blocks_needed(num_total_tokens) - have) + num_revived

    def allocate(self, request_id: BlockOwner, num_total_tokens: int, hit: PrefixHit | None = None) -> list[int] | None:
        """Grow the request's table to hold `num_total_tokens`; adopt `hit` blocks first if given.

        Returns the new block ids, or None (and changes nothing) if the pool
        cannot supply them.
        """
        table = self.block_tables.get(request_id)
        adopt = hit.blocks if hit is not None and table is None else []
        have = len(table) if table is not None else len(adopt)
        num_new = self.blocks_needed(num_total_tokens) - have
        # Adopted blocks nobody references yet are counted as free: touching them uses them up.
        num_revived = sum(1 for b in adopt if self.pool.ref_counts[b] == 0)
        if num_new + num_revived > self.pool.num_free_blocks:
            return None
        if table is None:
            self.pool.touch(adopt)
            table = self.block_tables[request_id] = list(adopt)
            self._memo.pop(request_id, None)
            self._num_committed[request_id] = len(adopt)
        new_blocks = self.pool.allocate(num_new) if num_new > 0 else []
        table.extend(new_blocks)
        return new_blocks

    def commit_full_blocks(self, request_id: BlockOwner, token_ids: Sequence[int], num_computed_tokens: int,
                           salt: bytes = b"") -> None:
        """Register the request's newly full, computed blocks in the prefix index."""
        table = self.block_tables.get(request_id)
        if not self.enable_prefix_caching or table is None:
            return
        hashes = extend_block_hashes(self._hashes.setdefault(request_id, []), token_ids, self.block_size,
                                     salt, limit=num_computed_tokens)
        start = self._num_committed.get(request_id, 0)
        end = min(len(hashes), len(table))
        for i in range(start, end):
            self.pool.cache_block(table[i], hashes[i])
        self._num_committed[request_id] = max(start, end)

    def rename(self, old_key: BlockOwner, new_key: BlockOwner) -> None:
        """Hand a block table (and its hashing progress) to a new owner key; no counts change."""
        if new_key in self.block_tables:
            raise KeyError(f"{new_key!r} already owns blocks")
        if old_key in self.block_tables:
            self.block_tables[new_key] = self.block_tables.pop(old_key)
        self._memo.pop(old_key, None)
        for table in (self._hashes, self._num_committed):
            if old_key in table:
                table[new_key] = table.pop(old_key)  # type: ignore[assignment]

    def trim(self, key: BlockOwner, num_tokens: int) -> int:
        """Keep KV for at most the first `num_tokens` tokens of `key`; return how many are kept.

        Blocks past the cut are released. A cut inside a block that is in the
        prefix index (full, possibly shared) drops that block too: it is
        immutable, and the next turn would write into it.
        """
        table = self.block_tables.get(key)
        if table is None:
            return 0
        keep_blocks = self.blocks_needed(num_tokens)
        num_full = num_tokens // self.block_size
        if keep_blocks > num_full and keep_blocks <= len(table) \
                and self._num_committed.get(key, 0) > num_full:
            keep_blocks = num_full
        if keep_blocks == 0:  # nothing left: forget the key, as `free` does (an empty table would block renames)
            self.free(key)
            return 0
        if keep_blocks < len(table):
            self.pool.free(table[keep_blocks:])
            del table[keep_blocks:]
        hashes = self._hashes.get(key)
        if hashes is not None and len(hashes) > num_full:
            del hashes[num_full:]
        if key in self._num_committed:
            self._num_committed[key] = min(self._num_committed[key], len(table), num_full)
        return min(num_tokens, keep_blocks * self.block_size)

    def num_blocks_of(self, key: BlockOwner) -> int:
        return len(self.block_tables.get(key, ()))

    def free(self, request_id: BlockOwner, keep_hashes: bool = False) -> None:
        """Release the request's blocks (cached ones stay reusable) and forget it.

        With `keep_hashes` the block hashes of its tokens are kept (a session whose KV moved to another
        tier): when its blocks come back, committing them needs no rehashing of the whole context.
        """
        table = self.block_tables.pop(request_id, None)
        if table:
            self.pool.free(table)
        if not keep_hashes:
            self._hashes.pop(request_id, None)
        self._num_committed.pop(request_id, None)
        self._memo.pop(request_id, None)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        counts = [0] * self.pool.num_blocks
        for table in self.block_tables.values():
            for block in table:
                counts[block] += 1
        assert counts == self.pool.ref_counts, "block tables and reference counts disagree"
        assert not self._memo.keys() & self.block_tables.keys(), "a request with a table kept its prefix memo"
