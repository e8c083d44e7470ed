"""Host and disk KV tiers: gather/scatter, int8 round trips, budgets, corruption and failure paths."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from sessionserve.cache import disk_tier as disk_tier_mod
from sessionserve.cache.disk_tier import HEADER_BYTES, CorruptKVError, DiskTier
from sessionserve.cache.host_tier import HostTier
from sessionserve.cache.kv_layout import KVLayout, gather_blocks, scatter_blocks
from sessionserve.cache.quant import dequantize_int8, quantize_int8

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, block_size=4, head_dim=8, dtype=torch.float32)
NUM_DEVICE_BLOCKS = 10


def make_caches(layout: KVLayout = LAYOUT, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_DEVICE_BLOCKS, layout.num_kv_heads, layout.block_size, layout.head_dim)
    return [(torch.randn(shape, generator=gen).to(layout.dtype),
             torch.randn(shape, generator=gen).to(layout.dtype)) for _ in range(layout.num_layers)]


def test_layout_sizes() -> None:
    assert LAYOUT.block_shape == (2, 2, 2, 4, 8)
    assert LAYOUT.block_bytes == 2 * 2 * 2 * 4 * 8 * 4
    assert KVLayout.from_kv_caches(make_caches()) == LAYOUT
    assert KVLayout(1, 1, 16, 64, torch.bfloat16).block_bytes == 2 * 16 * 64 * 2


def test_gather_scatter_moves_exact_blocks() -> None:
    caches = make_caches()
    ids = [7, 2, 5]
    group = gather_blocks(caches, ids)
    assert group.shape == (3, *LAYOUT.block_shape) and group.is_contiguous()
    for i, block in enumerate(ids):
        for layer, (k, v) in enumerate(caches):
            assert torch.equal(group[i, layer, 0], k[block]) and torch.equal(group[i, layer, 1], v[block])
    target = make_caches(seed=1)
    untouched = [(k.clone(), v.clone()) for k, v in target]
    scatter_blocks(target, [0, 9, 4], group)
    for layer in range(LAYOUT.num_layers):
        for kv in range(2):
            assert torch.equal(target[layer][kv][[0, 9, 4]], caches[layer][kv][ids])
            others = [1, 2, 3, 5, 6, 7, 8]
            assert torch.equal(target[layer][kv][others], untouched[layer][kv][others])
    assert gather_blocks(caches, []).shape == (0, *LAYOUT.block_shape)


def test_scatter_casts_and_rejects_bad_input() -> None:
    caches = make_caches()
    group = gather_blocks(caches, [1, 3]).double()
    scatter_blocks(caches, [4, 6], group)
    assert torch.equal(caches[1][1][4], caches[1][1][1])
    with pytest.raises(ValueError):
        scatter_blocks(caches, [4, 4], group)
    with pytest.raises(ValueError):
        scatter_blocks(caches, [4], group)
    with pytest.raises(IndexError):
        scatter_blocks(caches, [4, NUM_DEVICE_BLOCKS], group)


def test_host_round_trip_fp32_is_exact() -> None:
    caches = make_caches()
    host = HostTier(LAYOUT, budget_bytes=6 * LAYOUT.block_bytes)
    ids = [8, 0, 3, 4]
    host_ids = host.try_allocate(len(ids))
    assert host_ids is not None
    host.write(host_ids, gather_blocks(caches, ids))
    back = host.read(host_ids)
    assert back.dtype == torch.float32 and back.device.type == "cpu"
    target = make_caches(seed=2)
    scatter_blocks(target, ids, back)
    for layer in range(LAYOUT.num_layers):
        for kv in range(2):
            assert torch.equal(target[layer][kv][ids], caches[layer][kv][ids])
    host.free(host_ids)
    host.check_integrity()


def test_host_round_trip_non_contiguous_ids() -> None:
    host = HostTier(LAYOUT, budget_bytes=6 * LAYOUT.block_bytes)
    first = host.try_allocate(3)
    assert first == [0, 1, 2]
    host.free([first[1]])
    ids = host.try_allocate(4)  # 3, 4, 5, then 1: not one ascending run
    assert ids is not None and ids[-1] == 1
    data = torch.randn(4, *LAYOUT.block_shape)
    host.write(ids, data)
    assert torch.equal(host.read(ids), data)
    assert torch.equal(host.read(ids[1:3]), data[1:3])


def test_int8_error_within_bound() -> None:
    caches = make_caches()
    # One head-plane scaled way up: per-head scales keep the others precise.
    caches[0][0][2, 1] *= 1000.0
    host = HostTier(LAYOUT, budget_bytes=10 * LAYOUT.block_bytes, quantize_int8=True)
    ids = list(range(NUM_DEVICE_BLOCKS))
    host_ids = host.try_allocate(len(ids))
    assert host_ids is not None
    original = gather_blocks(caches, ids)
    host.write(host_ids, original)
    back = host.read(host_ids)
    assert back.dtype == torch.float32
    absmax = original.abs().amax(dim=-1, keepdim=True)  # one scale per token vector
    err = (back - original).abs().amax(dim=-1, keepdim=True)
    assert bool((err <= absmax / 254 * (1 + 1e-5)).all())
    assert float(err.max()) > 0  # it really was quantized


def test_quantize_zero_and_nonfinite() -> None:
    zeros = torch.zeros(1, 1, 2, 1, 4, 8)
    q, scales = quantize_int8(zeros)
    assert q.dtype == torch.int8 and scales.shape == (1, 1, 2, 1, 4, 1)
    assert torch.equal(dequantize_int8(q, scales, torch.float32), zeros)
    with pytest.raises(ValueError):
        quantize_int8(torch.tensor([[float("nan")]]))


def test_host_budget_is_never_exceeded() -> None:
    budget_bytes = 5 * LAYOUT.block_bytes + LAYOUT.block_bytes // 2
    host = HostTier(LAYOUT, budget_bytes)
    assert host.num_blocks == 5
    assert host.try_allocate(3) is not None
    assert host.try_allocate(3) is None and host.num_free_blocks == 2  # nothing taken
    last = host.try_allocate(2)
    assert last is not None and host.try_allocate(1) is None
    assert host.used_bytes == 5 * LAYOUT.block_bytes <= budget_bytes
    host.free(last)
    with pytest.raises(ValueError):
        host.free(last)  # double free is a bug, and frees nothing
    with pytest.raises(ValueError):
        host.write(last, torch.zeros(2, *LAYOUT.block_shape))  # not allocated any more
    host.check_integrity()
    assert host.num_free_blocks == 2


def test_int8_holds_about_3_8x_more_blocks() -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, block_size=16, head_dim=64, dtype=torch.float32)
    budget_bytes = 10 * layout.block_bytes
    fp32 = HostTier(layout, budget_bytes)
    int8 = HostTier(layout, budget_bytes, quantize_int8=True)
    assert fp32.num_blocks == 10
    assert int8.num_blocks >= 37 and int8.num_blocks * int8.stored_block_bytes <= budget_bytes
    assert int8.try_allocate(int8.num_blocks) is not None and int8.try_allocate(1) is None


def test_zero_budget_host_tier() -> None:
    host = HostTier(LAYOUT, 0, quantize_int8=True, pin_memory=True)  # pinning is a no-op on CPU-only
    assert host.num_blocks == 0 and host.try_allocate(1) is None
    assert host.try_allocate(0) == [] and host.used_bytes == 0
    host.check_integrity()


def test_host_allocate_free_from_two_threads() -> None:
    host = HostTier(LAYOUT, 64 * LAYOUT.block_bytes)

    def churn() -> None:
        for _ in range(200):
            ids = host.try_allocate(3)
            if ids is not None:
                host.free(ids)

    threads = [threading.Thread(target=churn) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    host.check_integrity()
    assert host.num_free_blocks == 64


def test_disk_round_trip_exact(tmp_path: Path) -> None:
    layout = KVLayout(2, 2, 4, 8, torch.bfloat16)
    caches = make_caches(layout)
    disk = DiskTier(layout, tmp_path / "spool", budget_bytes=1 << 20)
    assert (tmp_path / "spool").stat().st_mode & 0o777 == 0o700
    handle = disk.try_reserve(3)
    assert handle is not None and handle.size_bytes == HEADER_BYTES + 3 * layout.block_bytes
    group = gather_blocks(caches, [6, 1, 2])
    disk.write(handle, group)
    assert handle.path.stat().st_size == handle.size_bytes and disk.num_files == 1
    assert handle.path.name.endswith(".kv") and len(handle.path.stem) == 32
    back = disk.read(handle)
    assert back.dtype == torch.bfloat16 and torch.equal(back, group)
    assert list(handle.path.parent.iterdir()) == [handle.path]  # no temp file left


def test_disk_corrupt_byte_and_truncation(tmp_path: Path) -> None:
    disk = DiskTier(LAYOUT, tmp_path, budget_bytes=1 << 20)
    handles = [disk.try_reserve(2) for _ in range(3)]
    for handle in handles:
        assert handle is not None
        disk.write(handle, torch.randn(2, *LAYOUT.block_shape))
    payload_flip, header_flip, truncated = handles
    raw = bytearray(payload_flip.path.read_bytes())
    raw[HEADER_BYTES + 100] ^= 0x01
    payload_flip.path.write_bytes(bytes(raw))
    raw = bytearray(header_flip.path.read_bytes())
    raw[8] ^= 0x01  # num_blocks
    header_flip.path.write_bytes(bytes(raw))
    with open(truncated.path, "r+b") as f:
        f.truncate(truncated.size_bytes - 1)
    for handle in handles:
        with pytest.raises(CorruptKVError):
            disk.read(handle)
    disk.free(truncated)
    with pytest.raises(CorruptKVError):
        disk.read(truncated)  # missing file


def test_disk_budget_and_free_idempotent(tmp_path: Path) -> None:
    disk = DiskTier(LAYOUT, tmp_path, budget_bytes=2 * (HEADER_BYTES + 3 * LAYOUT.block_bytes))
    a, b = disk.try_reserve(3), disk.try_reserve(3)
    assert a is not None and b is not None and disk.try_reserve(1) is None
    assert disk.used_bytes == disk.budget_bytes
    disk.write(a, torch.zeros(3, *LAYOUT.block_shape))
    disk.free(a)
    disk.free(a)
    assert not a.path.exists() and disk.num_files == 0
    assert disk.used_bytes == b.size_bytes
    with pytest.raises(ValueError):
        disk.write(a, torch.zeros(3, *LAYOUT.block_shape))  # freed handle


def test_disk_unwritable_spool_raises_and_budget_released(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    disk = DiskTier(LAYOUT, spool, budget_bytes=1 << 20)
    handle = disk.try_reserve(2)
    assert handle is not None
    # Root ignores chmod, so make the spool path stop being a directory instead.
    spool.rmdir()
    spool.write_bytes(b"not a directory")
    with pytest.raises(OSError):
        disk.write(handle, torch.zeros(2, *LAYOUT.block_shape))
    assert disk.used_bytes == handle.size_bytes  # still reserved: the caller frees it
    disk.free(handle)
    assert disk.used_bytes == 0 and disk.num_files == 0
    with pytest.raises(OSError):
        DiskTier(LAYOUT, spool / "sub", budget_bytes=1)  # parent is a regular file


def test_disk_full_mid_write_leaves_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = DiskTier(LAYOUT, tmp_path, budget_bytes=1 << 20)
    handle = disk.try_reserve(2)
    assert handle is not None
    calls = {"n": 0}

    def fail_second_write(fd: int, data: memoryview) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_tier_mod, "_write_fully", fail_second_write)
    with pytest.raises(OSError):
        disk.write(handle, torch.zeros(2, *LAYOUT.block_shape))
    assert list(tmp_path.iterdir()) == [] and disk.num_files == 0
    disk.free(handle)
    assert disk.used_bytes == 0


def test_disk_close_removes_only_our_files(tmp_path: Path) -> None:
    disk = DiskTier(LAYOUT, tmp_path, budget_bytes=1 << 20)
    foreign = tmp_path / ("ab" * 16 + ".kv")  # looks like ours, from another live process
    foreign.write_bytes(b"old")
    assert disk.used_bytes == 0
    handles = [disk.try_reserve(1) for _ in range(3)]
    for handle in handles[:2]:
        assert handle is not None
        disk.write(handle, torch.ones(1, *LAYOUT.block_shape))
    assert disk.num_files == 2
    disk.close()
    assert list(tmp_path.iterdir()) == [foreign]
    assert disk.used_bytes == 0 and disk.num_files == 0
