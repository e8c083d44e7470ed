"""The virtual mover keeps ThreadMover's contract on the virtual clock."""

from __future__ import annotations

import pytest

from sessionserve.sim.clock import VirtualClock
from sessionserve.sim.mover import VirtualMover
from sessionserve.types.kv_mover import MoveKind, Tier


def make() -> tuple[VirtualClock, VirtualMover]:
    clock = VirtualClock()
    # 100-byte blocks, 10 host blocks, 1000 B/s host: one block moves in 0.1 s.
    return clock, VirtualMover(clock, 100, 10, 0, host_bytes_per_s=1000.0, disk_bytes_per_s=1.0)


def test_offload_completes_after_bytes_over_bandwidth_and_queues_in_order() -> None:
    clock, m = make()
    assert m.offload("a", [1, 2], Tier.HOST) and m.offload("b", [3], Tier.HOST)
    assert m.num_free_blocks(Tier.HOST) == 7  # reserved at once
    assert m.poll() == []
    clock.advance_to(0.2)
    (done,) = m.poll()
    assert done.session_id == "a" and done.kind is MoveKind.OFFLOAD and done.ok and done.num_bytes == 200
    assert m.next_done_s() == pytest.approx(0.3)  # b waited behind a: one worker
    m.wait(1.0)
    assert clock() == pytest.approx(0.3) and [d.session_id for d in m.poll()] == ["b"]


def test_restore_releases_the_copy_and_busy_copies_fail() -> None:
    clock, m = make()
    m.offload("a", [1, 2, 3], Tier.HOST)
    m.restore("a", [7, 8, 9])  # still being written: fails at once, as ThreadMover does
    (fail,) = m.poll()
    assert not fail.ok and fail.error == "missing"
    clock.advance_to(0.3)
    m.poll()
    m.restore("a", [7, 8, 9])
    clock.advance_to(0.6)
    (done,) = m.poll()
    assert done.kind is MoveKind.RESTORE and done.ok
    assert m.num_free_blocks(Tier.HOST) == 10


def test_tier_full_refuses_and_discard_frees() -> None:
    clock, m = make()
    assert m.offload("a", list(range(8)), Tier.HOST)
    assert not m.offload("b", [1, 2, 3], Tier.HOST) and m.num_free_blocks(Tier.HOST) == 2
    m.discard("a")  # busy: freed when the write ends
    assert m.num_free_blocks(Tier.HOST) == 2
    clock.advance_to(1.0)
    m.poll()
    assert m.num_free_blocks(Tier.HOST) == 10
    assert not m.offload("c", [1], Tier.DISK)  # no disk tier


def test_each_move_pays_the_fixed_latency() -> None:
    clock = VirtualClock()
    m = VirtualMover(clock, 100, 10, 0, host_bytes_per_s=1000.0, disk_bytes_per_s=1.0, move_latency_s=0.5)
    m.offload("a", [1], Tier.HOST)
    assert m.next_done_s() == pytest.approx(0.6)
