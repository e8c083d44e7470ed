"""The virtual-clock mover: implements `KVMover` with copies that take bytes / bandwidth of simulated time.

Same contract as `cache.mover.ThreadMover`: one worker takes jobs in order
(so moves queue behind each other), a tier's room is reserved at offload, a
copy is busy while a job reads or writes it, a restore of a busy or missing
copy fails at once (the caller recomputes), a restored copy is released. Only
block counts are kept: no data moves.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from sessionserve.sim.clock import VirtualClock
from sessionserve.types.kv_mover import MoveDone, MoveKind, Tier


@dataclass(slots=True)
class _Copy:
    tier: Tier
    num_blocks: int
    busy: bool = False
    discard_when_idle: bool = False
    released: bool = False


@dataclass(slots=True)
class _Job:
    session_id: str
    kind: MoveKind
    copy: _Copy
    seconds: float


class VirtualMover:
    """`KVMover` on a `VirtualClock`. Called from the engine (and the driver) only."""

    def __init__(self, clock: VirtualClock, block_bytes: int, num_host_blocks: int, num_disk_blocks: int,
                 host_bytes_per_s: float, disk_bytes_per_s: float, move_latency_s: float = 0.0) -> None:
        self.clock = clock
        self.move_latency_s = move_latency_s
        self.block_bytes = block_bytes
        self.capacity = {Tier.HOST: num_host_blocks, Tier.DISK: num_disk_blocks}
        self.used = {Tier.HOST: 0, Tier.DISK: 0}
        self.bytes_per_s = {Tier.HOST: host_bytes_per_s, Tier.DISK: disk_bytes_per_s}
        self._copies: dict[str, _Copy] = {}
        self._jobs: list[tuple[float, int, _Job]] = []  # (done at, order, job): the worker's queue
        self._worker_free_s = 0.0
        self._order = 0
        self._done: list[MoveDone] = []
        self.num_bytes_moved = 0

    # -- KVMover ----------------------------------------------------------------------------

    def num_free_blocks(self, tier: Tier) -> int:
        return self.capacity[tier] - self.used[tier]

    def offload(self, session_id: str, device_blocks: list[int], tier: Tier) -> bool:
        self.discard(session_id)
        n = len(device_blocks)
        if self.num_free_blocks(tier) < n:
            return False
        self.used[tier] += n
        copy = _Copy(tier, n, busy=True)
        self._copies[session_id] = copy
        self._submit(_Job(session_id, MoveKind.OFFLOAD, copy,
                          self.move_latency_s + n * self.block_bytes / self.bytes_per_s[tier]))
        return True

    def restore(self, session_id: str, device_blocks: list[int]) -> None:
        self._settle()
        copy = self._copies.get(session_id)
        if copy is None or copy.busy:
            self._done.append(MoveDone(session_id, MoveKind.RESTORE, copy.tier if copy else Tier.HOST, False, 0,
                                       0.0, "missing"))
            return
        copy.busy = True
        self._submit(_Job(session_id, MoveKind.RESTORE, copy,
                          self.move_latency_s + copy.num_blocks * self.block_bytes / self.bytes_per_s[copy.tier]))

    def discard(self, session_id: str) -> None:
        self._settle()
        copy = self._copies.pop(session_id, None)
        if copy is None:
            return
        if copy.busy:
            copy.discard_when_idle = True
            return
        self._release(copy)

    def poll(self) -> list[MoveDone]:
        self._settle()
        out, self._done = self._done, []
        return out

    def wait(self, timeout_s: float) -> None:
        """Advance the virtual clock to the next completion, or by `timeout_s` if none comes sooner."""
        t = self.clock() + timeout_s
        if self._jobs:
            t = min(t, self._jobs[0][0])
        self.clock.advance_to(t)

    # -- for the driver ---------------------------------------------------------------------

    def next_done_s(self) -> float | None:
        """When the earliest move in flight completes (simulated seconds), or None."""
        return self._jobs[0][0] if self._jobs else None

    # -- internals ----------------------------------------------------------------------------

    def _submit(self, job: _Job) -> None:
        start = max(self.clock(), self._worker_free_s)
        self._worker_free_s = start + job.seconds
        self._order += 1
        heapq.heappush(self._jobs, (self._worker_free_s, self._order, job))

    def _settle(self) -> None:
        """Complete every job whose time has come, in order (what the worker thread would have done)."""
        now = self.clock()
        while self._jobs and self._jobs[0][0] <= now:
            _, _, job = heapq.heappop(self._jobs)
            copy = job.copy
            copy.busy = False
            release = copy.discard_when_idle or job.kind is MoveKind.RESTORE
            if release and self._copies.get(job.session_id) is copy:
                del self._copies[job.session_id]
            if release:
                self._release(copy)
            num_bytes = copy.num_blocks * self.block_bytes
            self.num_bytes_moved += num_bytes
            self._done.append(MoveDone(job.session_id, job.kind, copy.tier, True, num_bytes, job.seconds))

    def _release(self, copy: _Copy) -> None:
        if not copy.released:
            copy.released = True
            self.used[copy.tier] -= copy.num_blocks
