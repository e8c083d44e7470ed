"""The device-tier block pool: free list, reference counts and the prefix-cache index.

A block is a fixed number of token slots in the KV tensors. The pool owns no
tensors: it hands out block ids and tracks who uses them. A full block may be
*cached*: registered under the chained hash of its tokens so that later
requests with the same prefix reuse it. A cached block whose last user freed
it stays cached (and evictable) until the pool needs the space; eviction takes
the least recently freed cached block.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import NamedTuple


class PrefixStats(NamedTuple):
    num_queried_tokens: int
    num_hit_tokens: int
    num_evicted_blocks: int


class BlockPool:
    """Ids 0..num_blocks-1 with reference counts and a hash -> block index.

    Invariants (see `check_integrity`): a block is in exactly one of
    {uncached free list, evictable LRU, in use (ref_count > 0)}; every hashed
    block is in `_by_hash` under its own hash.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_blocks))  # never cached, ready to use
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced, LRU first
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_evicted_blocks = 0
        self.num_shared_blocks = 0  # blocks with more than one reference (prefix hits, forks)
        self.num_sharing_changes = 0  # times a block became shared or stopped being shared
        # Called once per `allocate` that evicted cached blocks, with their (block, hash) pairs, before anyone
        # writes to them (a host-memory prefix cache copies them there in one go). None: evicted blocks are
        # simply forgotten.
        self.on_evict: Callable[[list[tuple[int, bytes]]], None] | None = None
        # Blocks taken out of the index, in order (`uncached_since`): a caller that looked up a run of blocks
        # checks only what left the index since, not the whole run again. Trimmed from the front.
        self._uncached_log: list[int] = []
        self._uncached_base = 0  # absolute position of _uncached_log[0]

    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate` can hand out now (cached-but-unused ones included)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    def can_allocate(self, num: int) -> bool:
        return num <= self.num_free_blocks

    def allocate(self, num: int) -> list[int]:
        """Take `num` blocks (ref count 1 each), evicting LRU cached blocks if needed.

        Raises MemoryError if fewer than `num` are free; allocates nothing then.
        """
        if num > self.num_free_blocks:
            raise MemoryError(f"need {num} KV blocks, {self.num_free_blocks} free")
        out: list[int] = []
        evicted: list[tuple[int, bytes]] = []
        for _ in range(num):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                if self.on_evict is not None:
                    evicted.append((block, self._hash_of[block]))  # type: ignore[arg-type]
                self._uncache(block)
                self.num_evicted_blocks += 1
            self.ref_counts[block] = 1
            out.append(block)
        if evicted:
            self.on_evict(evicted)  # type: ignore[misc]
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block. Blocks reaching zero become reusable.

        Freed in reverse so a sequence's tail blocks (least likely shared) are
        evicted before its head.
        """
        for block in reversed(blocks):
            count = self.ref_counts[block] - 1
            if count < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            self.ref_counts[block] = count
            if count == 1:
                self.num_shared_blocks -= 1
                self.num_sharing_changes += 1
            elif count == 0:
                if self._hash_of[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def touch(self, blocks: list[int]) -> None:
        """Add one reference to each (cached) block, taking it off the evictable list."""
        for block in blocks:
            count = self.ref_counts[block]
            if count == 0:
                self._evictable.pop(block, None)
            elif count == 1:
                self.num_shared_blocks += 1
                self.num_sharing_changes += 1
            self.ref_counts[block] = count + 1

    def lookup(self, block_hash: bytes) -> int | None:
        """The cached block holding `block_hash`, or None. Does not change any count."""
        return self._by_hash.get(block_hash)

    def cache_block(self, block: int, block_hash: bytes) -> bool:
        """Register a full, in-use block under its hash. False if another block has it already."""
        if block_hash in self._by_hash or self._hash_of[block] is not None:
            return False
        self._hash_of[block] = block_hash
        self._by_hash[block_hash] = block
        return True

    def uncache_mark(self) -> int:
        """A position in the log of blocks leaving the index, for `uncached_since`."""
        return self._uncached_base + len(self._uncached_log)

    def uncached_since(self, mark: int) -> list[int] | None:
        """Blocks taken out of the index since `mark` (repeats possible), or None if the log no longer
        reaches back that far (treat every block as gone)."""
        start = mark - self._uncached_base
        return None if start < 0 else self._uncached_log[start:]

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def stats(self) -> PrefixStats:
        return PrefixStats(self.num_queried_tokens, self.num_hit_tokens, self.num_evicted_blocks)

    def reset_prefix_cache(self) -> int:
        """Forget every unreferenced cached block. Returns how many were dropped."""
        dropped = list(self._evictable)
        for block in dropped:
            self._uncache(block)
            self._free.append(block)
        self._evictable.clear()
        return len(dropped)

    def _uncache(self, block: int) -> None:
        block_hash = self._hash_of[block]
        if block_hash is not None:
            del self._by_hash[block_hash]
            self._hash_of[block] = None
            log = self._uncached_log
            log.append(block)
            if len(log) > 2 * self.num_blocks + 1024:
                cut = len(log) // 2
                del log[:cut]
                self._uncached_base += cut

    def check_integrity(self) -> None:
        """Raise AssertionError if the pool's invariants do not hold."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "duplicate block in free list"
        assert not free & evictable, "block both free and evictable"
        for block in range(self.num_blocks):
            in_use = self.ref_counts[block] > 0
            assert self.ref_counts[block] >= 0
            assert in_use + (block in free) + (block in evictable) == 1, f"block {block} in {in_use=}"
            if block in evictable:
                assert self._hash_of[block] is not None, "uncached block on the evictable list"
        assert self.num_shared_blocks == sum(1 for c in self.ref_counts if c > 1), "shared block count out of sync"
        for block_hash, block in self._by_hash.items():
            assert self._hash_of[block] == block_hash, "hash index out of sync"
