"""Session stores: compare-and-set, owner index and drain, across processes; Redis against a real server."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from sessionserve.router.store import MemoryStore, RedisStore, SessionRecord, SessionStore, SQLiteStore, make_store


@pytest.fixture(params=["memory", "sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> SessionStore:
    if request.param == "memory":
        s: SessionStore = MemoryStore()
    elif request.param == "sqlite":
        s = SQLiteStore(tmp_path / "sessions.db")
    else:
        s = RedisStore(request.getfixturevalue("redis_url"), prefix=f"t{uuid.uuid4().hex}:")
    yield s
    s.close()


def test_put_get_roundtrip(store: SessionStore) -> None:
    rec = SessionRecord("alice/s1", "alice", token_ids=(1, 2, 3), messages=({"role": "user", "content": "hi"},),
                        owner="r0", tier="device", last_turn_hash="h", last_response='{"x": 1}')
    stored = store.put(rec)
    assert stored is not None and stored.version == 1 and stored.updated_s > 0
    got = store.get("alice/s1")
    assert got == stored
    assert store.get("alice/none") is None


def test_compare_and_set(store: SessionStore) -> None:
    v1 = store.put(SessionRecord("k", "t", token_ids=(1,)))
    assert store.put(SessionRecord("k", "t", token_ids=(9,))) is None  # version 0 but it exists
    v2 = store.put(replace(v1, token_ids=(1, 2)))
    assert v2.version == 2
    assert store.put(replace(v1, token_ids=(1, 3))) is None  # stale writer loses, nothing written
    assert store.get("k").token_ids == (1, 2)


def test_concurrent_writers_one_wins_each_version(store: SessionStore) -> None:
    store.put(SessionRecord("k", "t"))

    def append(i: int) -> int:
        wins = 0
        for _ in range(20):
            while True:
                cur = store.get("k")
                if store.put(replace(cur, token_ids=cur.token_ids + (i,))) is not None:
                    wins += 1
                    break
        return wins

    with ThreadPoolExecutor(4) as pool:
        assert sum(pool.map(append, range(4))) == 80
    rec = store.get("k")
    assert len(rec.token_ids) == 80 and rec.version == 81  # no lost and no duplicated append


def test_owner_index_and_release(store: SessionStore) -> None:
    for i in range(3):
        store.put(SessionRecord(f"t/s{i}", "t", owner="r0", tier="device"))
    store.put(SessionRecord("t/x", "t", owner="r1"))
    moved = store.put(replace(store.get("t/s2"), owner="r1"))
    assert moved is not None
    assert sorted(store.owned_by("r0")) == ["t/s0", "t/s1"]
    assert sorted(store.owned_by("r1")) == ["t/s2", "t/x"]
    assert sorted(store.release("r0")) == ["t/s0", "t/s1"]
    assert store.owned_by("r0") == []
    assert store.get("t/s0").owner is None and store.get("t/s0").version == 2
    assert store.delete("t/x") and not store.delete("t/x")
    assert store.owned_by("r1") == ["t/s2"]


def test_sqlite_is_shared_between_connections(tmp_path: Path) -> None:
    a, b = SQLiteStore(tmp_path / "s.db"), make_store(f"sqlite://{tmp_path / 's.db'}")
    rec = a.put(SessionRecord("k", "t", token_ids=(5,)))
    assert b.get("k") == rec
    assert b.put(replace(rec, owner="r1")) is not None
    assert a.put(replace(rec, owner="r2")) is None


def test_redis_is_shared_between_clients(redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex}:"
    a, b = RedisStore(redis_url, prefix), RedisStore(redis_url, prefix)
    rec = a.put(SessionRecord("k", "t", token_ids=(5,), owner="r0"))
    assert b.get("k") == rec
    assert b.put(replace(rec, owner="r1")) is not None
    assert a.put(replace(rec, owner="r2")) is None
    assert a.owned_by("r1") == ["k"] and a.owned_by("r0") == []
    assert isinstance(make_store(redis_url), RedisStore) and isinstance(make_store(None), MemoryStore)
