"""The background mover: copies parked sessions' KV between the device pool and host/disk tiers.

Implements `types.kv_mover.KVMover`. One worker thread takes jobs in order;
PyTorch copies release the GIL, so the engine loop keeps stepping while a
session moves. (On CUDA the copies go to pinned host memory; the worker's
copies then overlap compute on the default stream's idle time.) Every job
records bytes and seconds, so the policies see measured bandwidths.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sessionserve.cache.disk_tier import CorruptKVError, DiskHandle, DiskTier
from sessionserve.cache.host_tier import HostTier
from sessionserve.cache.kv_layout import KVCaches, KVLayout, gather_blocks, scatter_blocks
from sessionserve.types.kv_mover import MoveDone, MoveKind, Tier

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Copy:
    """A session's stored copy in one tier."""

    tier: Tier
    num_blocks: int
    host_ids: list[int] | None = None
    disk: DiskHandle | None = None
    busy: bool = False  # a job is reading or writing it
    discard_when_idle: bool = False


@dataclass(slots=True)
class _Job:
    session_id: str
    kind: MoveKind
    copy: _Copy
    device_blocks: list[int] = field(default_factory=list)


@dataclass(slots=True)
class MoverStats:
    num_bytes: dict[str, int] = field(default_factory=dict)  # "offload:host" -> bytes
    seconds: dict[str, float] = field(default_factory=dict)
    num_failures: dict[str, int] = field(default_factory=dict)

    def add(self, key: str, num_bytes: int, seconds: float) -> None:
        self.num_bytes[key] = self.num_bytes.get(key, 0) + num_bytes
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds

    def bandwidth(self, key: str) -> float | None:
        """Measured bytes/s for a direction and tier, or None before any move."""
        s = self.seconds.get(key, 0.0)
        return self.num_bytes.get(key, 0) / s if s > 0 else None


class ThreadMover:
    """KV mover with one worker thread. All public methods are called from the engine thread."""

    def __init__(self, kv_caches: KVCaches, host: HostTier | None, disk: DiskTier | None,
                 when_idle: Callable[[], None] | None = None) -> None:
        """`when_idle` runs on the worker each time it runs out of jobs (e.g. to let go of the compute
        threads its copies started, so that they do not keep the engine's from spinning)."""
        self.kv_caches = kv_caches
        self.when_idle = when_idle
        self.layout = KVLayout.from_kv_caches(kv_caches)
        self.block_bytes = self.layout.block_bytes
        self.host = host
        self.disk = disk
        self.stats = MoverStats()
        self._copies: dict[str, _Copy] = {}
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._done: queue.Queue[MoveDone] = queue.Queue()
        self._finished: list[tuple[_Job, MoveDone]] = []
        self._lock = threading.Lock()
        self._worker = threading.Thread(target=self._run, name="kv-mover", daemon=True)
        self._worker.start()

    # -- KVMover -------------------------------------------------------------------------

    def num_free_blocks(self, tier: Tier) -> int:
        if tier is Tier.HOST:
            return self.host.num_free_blocks if self.host is not None else 0
        if self.disk is None:
            return 0
        return max(0, (self.disk.budget_bytes - self.disk.used_bytes) // self.block_bytes)

    def offload(self, session_id: str, device_blocks: list[int], tier: Tier) -> bool:
        self.discard(session_id)
        n = len(device_blocks)
        copy = _Copy(tier, n)
        if tier is Tier.HOST:
            ids = self.host.try_allocate(n) if self.host is not None else None
            if ids is None:
                return False
            copy.host_ids = ids
        else:
            handle = self.disk.try_reserve(n) if self.disk is not None else None
            if handle is None:
                return False
            copy.disk = handle
        copy.busy = True
        with self._lock:
            self._copies[session_id] = copy
        self._jobs.put(_Job(session_id, MoveKind.OFFLOAD, copy, list(device_blocks)))
        return True

    def restore(self, session_id: str, device_blocks: list[int]) -> None:
        with self._lock:
            copy = self._copies.get(session_id)
            usable = copy is not None and not copy.busy
            if usable:
                copy.busy = True
        if not usable:
            # Nothing to read (or still being written): report failure, the caller recomputes.
            self._done.put(MoveDone(session_id, MoveKind.RESTORE, copy.tier if copy else Tier.HOST, False, 0, 0.0,
                                    "missing"))
            return
        self._jobs.put(_Job(session_id, MoveKind.RESTORE, copy, list(device_blocks)))

    def discard(self, session_id: str) -> None:
        with self._lock:
            copy = self._copies.pop(session_id, None)
            if copy is None:
                return
            if copy.busy:
                copy.discard_when_idle = True
                return
        self._release(copy)

    def poll(self) -> list[MoveDone]:
        out: list[MoveDone] = []
        while True:
            try:
                done = self._done.get_nowait()
            except queue.Empty:
                return out
            out.append(done)

    def wait(self, timeout_s: float) -> None:
        try:
            done = self._done.get(timeout=timeout_s)
        except queue.Empty:
            return
        self._done.put(done)  # keep it for poll(); ordering among completions does not matter

    def close(self) -> None:
        """Stop the worker and release every stored copy."""
        self._jobs.put(None)
        self._worker.join(timeout=10)
        for copy in list(self._copies.values()):
            self._release(copy)
        self._copies.clear()
        if self.disk is not None:
            self.disk.close()

    @property
    def num_stored(self) -> int:
        return len(self._copies)

    # -- worker ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            t0 = time.perf_counter()
            ok, error, num_bytes = True, None, job.copy.num_blocks * self.block_bytes
            try:
                if job.kind is MoveKind.OFFLOAD:
                    data = gather_blocks(self.kv_caches, job.device_blocks)
                    if job.copy.tier is Tier.HOST:
                        self.host.write(job.copy.host_ids, data)
                    else:
                        self.disk.write(job.copy.disk, data)
                else:
                    if job.copy.tier is Tier.HOST:
                        data = self.host.read(job.copy.host_ids)
                    else:
                        data = self.disk.read(job.copy.disk)
                    scatter_blocks(self.kv_caches, job.device_blocks, data)
            except CorruptKVError as exc:
                ok, error = False, "corrupt"
                logger.warning("session %s: stored KV is corrupt (%s); it will be recomputed", job.session_id, exc)
            except OSError as exc:
                ok, error = False, "io"
                logger.warning("session %s: KV %s to %s failed: %s", job.session_id, job.kind.value,
                               job.copy.tier.value, exc)
            except Exception as exc:
                ok, error = False, repr(exc)
                logger.exception("session %s: KV move failed", job.session_id)
            seconds = time.perf_counter() - t0
            key = f"{job.kind.value}:{job.copy.tier.value}"
            with self._lock:
                if ok:
                    self.stats.add(key, num_bytes, seconds)
                else:
                    self.stats.num_failures[key] = self.stats.num_failures.get(key, 0) + 1
            self._finish(job, MoveDone(job.session_id, job.kind, job.copy.tier, ok, num_bytes if ok else 0,
                                       seconds, error))
            if self.when_idle is not None and self._jobs.empty():
                self.when_idle()

    def _finish(self, job: _Job, done: MoveDone) -> None:
        copy = job.copy
        with self._lock:
            copy.busy = False
            # A restored or failed copy is not kept: the device has the data, or it is unusable.
            release = copy.discard_when_idle or not done.ok or job.kind is MoveKind.RESTORE
            if release and self._copies.get(job.session_id) is copy:
                del self._copies[job.session_id]
        if release:
            self._release(copy)
        self._done.put(done)

    def _release(self, copy: _Copy) -> None:
        if copy.host_ids is not None and self.host is not None:
            self.host.free(copy.host_ids)
            copy.host_ids = None
        if copy.disk is not None and self.disk is not None:
            self.disk.free(copy.disk)
            copy.disk = None
