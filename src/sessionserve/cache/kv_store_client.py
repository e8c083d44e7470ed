"""The engine's side of the KV store (a folder replicas share): write finished requests' blocks through, load missing prefixes.

`export` (engine thread) copies the full blocks of a finished request that
the store may not have yet out of the device caches (one gather) and queues
them; a writer thread puts them in the `KVStore`. The blocks it believes
stored are touched instead (the folder's trim is LRU by mtime, so a prefix
every session reuses stays); one found gone (another replica's trim) is
forgotten, and written again the next time a request finishes with it. `load` (engine thread, the
KV manager's `lower` tier, called when the scheduler looks up a waiting
request's cached prefix) reads the run of blocks that follows the request's
device-cached prefix from the store into free device blocks and registers
them in the prefix cache, unreferenced: the scheduler then admits the request
with them as an ordinary prefix hit, and if memory runs short first they are
evicted like any cached block. Nothing here changes what a request computes,
only how much of it is computed again.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sessionserve.cache.block_pool import BlockPool
from sessionserve.cache.kv_layout import KVCaches, KVLayout, gather_blocks, scatter_blocks
from sessionserve.cache.kv_store import KVStore
from sessionserve.cache.lower_tier import load_blocks

logger = logging.getLogger(__name__)

_MAX_KNOWN = 1 << 20  # hashes remembered as stored (16 bytes each), oldest forgotten first
_MAX_TOUCHES = 1024  # finished requests' known blocks waiting to be touched


@dataclass
class KVStoreStats:
    num_blocks_written: int = 0  # blocks this engine put in the store
    num_blocks_loaded: int = 0  # blocks read from the store into the device cache
    num_blocks_dropped: int = 0  # blocks not written: the write queue was full, or the write failed
    num_loads: int = 0  # requests that got at least one block from the store
    num_blocks_gone: int = 0  # blocks this engine had stored that were gone when next used (trimmed)


class KVStoreClient:
    """Write-through and load of full KV blocks against one shared store."""

    def __init__(self, store: KVStore, kv_caches: KVCaches, pool: BlockPool,
                 max_pending_bytes: int = 256 << 20) -> None:
        self.store = store
        self.kv_caches = kv_caches
        self.pool = pool
        self.block_bytes = KVLayout.from_kv_caches(kv_caches).block_bytes
        self._write = device_writer(kv_caches)
        self.max_pending_blocks = max(1, max_pending_bytes // self.block_bytes)
        self.stats = KVStoreStats()
        self._known: OrderedDict[bytes, None] = OrderedDict()  # in the store (written or read by us)
        self._queue: deque[tuple[list[bytes], torch.Tensor]] = deque()
        self._touches: deque[list[bytes]] = deque()  # known blocks to touch (writer thread)
        self._gone: list[bytes] = []  # known blocks the writer found removed; forgotten at the next export
        self._touching = False
        self._num_pending = 0
        self._cond = threading.Condition()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="kv-store-writer", daemon=True)
        self._writer.start()

    def export(self, block_hashes: list[bytes]) -> int:
        """Queue the device blocks cached under `block_hashes` that the store may lack. Returns how many.

        Call on the engine thread, before another step can reuse the blocks (e.g. right after the request
        finished: its blocks are cached and unreferenced, their data intact until evicted).
        """
        with self._cond:
            gone, self._gone = self._gone, []
        for h in gone:
            self._known.pop(h, None)
        hashes, blocks, known = [], [], []
        for h in block_hashes:
            if h in self._known:
                known.append(h)
                continue
            block = self.pool.lookup(h)
            if block is None:
                break  # not computed (or evicted): nor is anything after it in the chain
            hashes.append(h)
            blocks.append(block)
        if known:
            with self._cond:
                if len(self._touches) < _MAX_TOUCHES:  # else skipped: recency only, the writer is behind
                    self._touches.append(known)
                self._cond.notify()
        if not hashes:
            return 0
        with self._cond:
            if self._num_pending + len(hashes) > self.max_pending_blocks:
                self.stats.num_blocks_dropped += len(hashes)
                return 0
            self._num_pending += len(hashes)
        data = gather_blocks(self.kv_caches, blocks)  # a copy: the blocks may be reused from the next step on
        if data.device.type != "cpu":
            data = data.to("cpu")
        self._remember(hashes)
        with self._cond:
            self._queue.append((hashes, data))
            self._cond.notify()
        return len(hashes)

    def load(self, block_hashes: list[bytes]) -> int:
        """Bring the blocks after the device-cached prefix of `block_hashes` in from the store. Returns how many.

        The engine's `KVCacheManager.lower` (see `load_blocks`).
        """
        hashes = load_blocks(self.store, self.pool, block_hashes, self._write)
        if hashes:
            self._remember(hashes)
            self.stats.num_blocks_loaded += len(hashes)
            self.stats.num_loads += 1
        return len(hashes)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued block is written (and touched). False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._num_pending == 0 and not self._touches and not self._touching,
                                       timeout=timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued (up to `timeout_s`), then stop the writer."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._writer.join(timeout=5)

    def _remember(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._known[h] = None
        while len(self._known) > _MAX_KNOWN:
            self._known.popitem(last=False)

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._touches or self._closed)
                touches = list(self._touches)
                self._touches.clear()
                job = self._queue.popleft() if self._queue else None
                if job is None and not touches:
                    return
                self._touching = bool(touches)
            if touches:
                gone = [h for hs in touches for h in hs if not self.store.touch(h)]
                with self._cond:
                    self._gone.extend(gone)
                    self.stats.num_blocks_gone += len(gone)
                    self._touching = False
                    self._cond.notify_all()
            if job is None:
                continue
            hashes, data = job
            written = 0
            try:
                for i, h in enumerate(hashes):
                    written += self.store.put(h, data[i])
            except OSError as exc:
                logger.warning("KV store write failed: %s", exc)
                with self._cond:
                    self.stats.num_blocks_dropped += len(hashes) - written
            with self._cond:
                self.stats.num_blocks_written += written
                self._num_pending -= len(hashes)
                self._cond.notify_all()


def device_writer(kv_caches: KVCaches) -> Callable[[list[int], list[torch.Tensor]], None]:
    """`load_blocks`' `write` for real KV caches: block tensors (L, 2, Hkv, bs, D) into device blocks."""
    return lambda blocks, datas: scatter_blocks(kv_caches, blocks, torch.stack(datas))
