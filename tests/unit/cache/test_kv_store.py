"""The KV store folder: blocks by hash, checked on read, least recently used removed past the budget."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from sessionserve.cache.kv_layout import KVLayout
from sessionserve.cache.kv_store import KVStore, model_namespace

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, block_size=4, head_dim=8, dtype=torch.float32)


def block(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.block_shape, generator=torch.Generator().manual_seed(seed))


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_put_get_roundtrip_and_second_put_is_a_no_op(tmp_path: Path) -> None:
    store = KVStore(tmp_path, "ns", LAYOUT, 1 << 20)
    assert not store.contains(key(1)) and store.get(key(1)) is None
    assert store.put(key(1), block(1))
    assert not store.put(key(1), block(2))  # equal names mean equal content: the first stays
    assert torch.equal(store.get(key(1)), block(1))
    assert store.path(key(1)).parent.parent == tmp_path / "ns"
    assert oct(os.stat(tmp_path / "ns").st_mode & 0o777) == "0o700"
    # Another store on the same folder (another replica) sees it.
    assert torch.equal(KVStore(tmp_path, "ns", LAYOUT, 1 << 20).get(key(1)), block(1))
    assert list(tmp_path.glob("ns/*/*.tmp")) == []


def test_corrupt_or_foreign_file_reads_as_absent_and_is_removed(tmp_path: Path) -> None:
    store = KVStore(tmp_path, "ns", LAYOUT, 1 << 20)
    store.put(key(1), block(1))
    path = store.path(key(1))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.get(key(1)) is None and not path.exists() and store.num_corrupt == 1
    # A file of another layout under the name (a misconfigured folder) is rejected, not misread.
    other = KVStore(tmp_path, "ns", KVLayout(2, 2, 4, 8, torch.bfloat16), 1 << 20)
    other.put(key(2), block(2).to(torch.bfloat16))
    assert store.get(key(2)) is None


def test_trim_removes_least_recently_used_first(tmp_path: Path) -> None:
    budget = 10 * KVStore(tmp_path, "x", LAYOUT, 1).file_bytes
    store = KVStore(tmp_path, "ns", LAYOUT, budget)
    for i in range(10):
        store.put(key(i), block(i))
        os.utime(store.path(key(i)), (1000 + i, 1000 + i))
    store.get(key(0))  # read: now the most recent
    store.put(key(10), block(10))  # past the budget: trim to 90%
    present = {i for i in range(11) if store.contains(key(i))}
    assert 0 in present and 10 in present
    assert 1 not in present and 2 not in present  # the oldest untouched ones went
    assert store.used_bytes <= budget * 0.9 and store.num_trimmed == 2


def test_namespace_pins_config_weights_and_layout(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (model / "model.safetensors").write_bytes(b"a" * 3000)
    base = model_namespace(model, LAYOUT)
    assert base == model_namespace(model, LAYOUT)
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    assert model_namespace(copy, LAYOUT) == base  # the same model in another folder shares
    (copy / "model.safetensors").write_bytes(b"a" * 2999 + b"b")
    assert model_namespace(copy, LAYOUT) != base  # other weights
    (copy / "model.safetensors").write_bytes(b"a" * 3000)
    (copy / "config.json").write_text(json.dumps({"hidden_size": 9}))
    assert model_namespace(copy, LAYOUT) != base  # other config
    assert model_namespace(model, KVLayout(2, 2, 4, 8, torch.bfloat16)) != base  # other KV dtype
    assert model_namespace(model, KVLayout(2, 2, 8, 8, torch.float32)) != base  # other block size


def test_budget_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        KVStore(tmp_path, "ns", LAYOUT, 0)
