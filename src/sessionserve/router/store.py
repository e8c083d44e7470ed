"""Session state outside the replica: one `SessionStore` interface, three implementations.

A record is what another replica needs to continue a session: its message
history and token ids, where its KV lives (owner replica and tier), its
tenant, and the last turn (a fingerprint of the request and the response, so
a retried turn is answered once, never run twice). Every write is a
compare-and-set on `version`: two replicas can never both append a turn.

- `MemoryStore`: one process (tests, a single server).
- `SQLiteStore`: the embedded default; one file, shared by every replica on a machine.
- `RedisStore`: many machines (`redis://host:port/db`).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SessionRecord:
    key: str  # tenant-namespaced session id ("tenant/session")
    tenant: str
    version: int = 0  # 0: not stored yet; each successful put stores version + 1
    token_ids: tuple[int, ...] = ()  # the session's history as the engine holds it
    messages: tuple[dict[str, Any], ...] = ()  # the last request's messages (the conversation so far)
    owner: str | None = None  # replica holding its KV; None after a drain or before the first turn
    tier: str | None = None  # where the owner keeps it: device | host | disk | dropped
    spool_path: str | None = None  # the disk-tier file, when a shared disk can reach it
    last_turn_hash: str | None = None  # fingerprint of the last request that completed
    last_response: str | None = None  # its response body (JSON), replayed if the same request comes again
    # Where its conversation stands (the server's transcript: digest, stop_text, stopped), so a replica
    # that continues the session splices the next turn onto the same tokens.
    transcript: dict[str, Any] | None = None
    updated_s: float = field(default=0.0)  # wall time of the last write

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> SessionRecord:
        d = json.loads(raw)
        d["token_ids"] = tuple(d.get("token_ids", ()))
        d["messages"] = tuple(d.get("messages", ()))
        return cls(**d)


class SessionStore(ABC):
    """Shared session records. Thread-safe; each method is one atomic operation on the store."""

    @abstractmethod
    def get(self, key: str) -> SessionRecord | None:
        """The current record, or None. Reads only."""

    @abstractmethod
    def put(self, record: SessionRecord) -> SessionRecord | None:
        """Compare-and-set: store `record` as version `record.version + 1` if the stored version is
        `record.version` (0: absent). Returns the stored record, or None on conflict (nothing written)."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove a record; True if it existed."""

    @abstractmethod
    def owned_by(self, owner: str) -> list[str]:
        """Keys whose owner is `owner`. Reads only."""

    def release(self, owner: str) -> list[str]:
        """Drain: clear `owner` from every record it owns (each a CAS, retried on conflict). Returns the keys."""
        released = []
        for key in self.owned_by(owner):
            while (rec := self.get(key)) is not None and rec.owner == owner:
                if self.put(replace(rec, owner=None, tier=None)) is not None:
                    released.append(key)
                    break
        return released

    def close(self) -> None:
        """Release connections."""


def _stamped(record: SessionRecord) -> SessionRecord:
    return replace(record, version=record.version + 1, updated_s=time.time())


class MemoryStore(SessionStore):
    def __init__(self) -> None:
        self._records: dict[str, SessionRecord] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> SessionRecord | None:
        with self._lock:
            return self._records.get(key)

    def put(self, record: SessionRecord) -> SessionRecord | None:
        with self._lock:
            cur = self._records.get(record.key)
            if (cur.version if cur else 0) != record.version:
                return None
            new = _stamped(record)
            self._records[record.key] = new
            return new

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._records.pop(key, None) is not None

    def owned_by(self, owner: str) -> list[str]:
        with self._lock:
            return [k for k, r in self._records.items() if r.owner == owner]


class SQLiteStore(SessionStore):
    """One SQLite file (WAL) that every process on the machine opens; CAS inside one IMMEDIATE transaction."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        with self._conn() as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("CREATE TABLE IF NOT EXISTS sessions (key TEXT PRIMARY KEY, version INTEGER NOT NULL, "
                         "owner TEXT, data TEXT NOT NULL)")
            conn.execute("CREATE INDEX IF NOT EXISTS sessions_owner ON sessions(owner)")

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            # NOTE: one connection per thread; autocommit off so BEGIN IMMEDIATE takes the write lock up front.
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=True)
            self._local.conn = conn
        return conn

    def get(self, key: str) -> SessionRecord | None:
        row = self._conn().execute("SELECT data FROM sessions WHERE key = ?", (key,)).fetchone()
        return SessionRecord.from_json(row[0]) if row else None

    def put(self, record: SessionRecord) -> SessionRecord | None:
        conn = self._conn()
        new = _stamped(record)
        conn.execute("BEGIN IMMEDIATE")
        try:
            row = conn.execute("SELECT version FROM sessions WHERE key = ?", (record.key,)).fetchone()
            if (row[0] if row else 0) != record.version:
                conn.execute("ROLLBACK")
                return None
            conn.execute("INSERT OR REPLACE INTO sessions (key, version, owner, data) VALUES (?, ?, ?, ?)",
                         (new.key, new.version, new.owner, new.to_json()))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return new

    def delete(self, key: str) -> bool:
        return self._conn().execute("DELETE FROM sessions WHERE key = ?", (key,)).rowcount > 0

    def owned_by(self, owner: str) -> list[str]:
        return [r[0] for r in self._conn().execute("SELECT key FROM sessions WHERE owner = ?", (owner,))]

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


# KEYS[1] record hash, KEYS[2] owner-index prefix; ARGV: expected version, new version, data, new owner ("" = none)
_CAS_LUA = """
local cur = redis.call('HGET', KEYS[1], 'version')
if (cur == false and ARGV[1] ~= '0') or (cur ~= false and cur ~= ARGV[1]) then return 0 end
local old = redis.call('HGET', KEYS[1], 'owner')
if old and old ~= '' and old ~= ARGV[4] then redis.call('SREM', KEYS[2] .. old, KEYS[1]) end
redis.call('HSET', KEYS[1], 'version', ARGV[2], 'data', ARGV[3], 'owner', ARGV[4])
if ARGV[4] ~= '' then redis.call('SADD', KEYS[2] .. ARGV[4], KEYS[1]) end
return 1
"""


class RedisStore(SessionStore):
    """Records as Redis hashes (`<prefix>s:<key>`), CAS in a Lua script, an owner -> keys set for drains.

    NOTE: the script touches the owner set it derives from the record, so this needs one Redis (or one
    hash slot), not a sharded cluster.
    """

    def __init__(self, url: str, prefix: str = "sessionserve:") -> None:
        import redis  # optional dependency: `pip install sessionserve[ray]`

        self.url = url
        self.prefix = prefix
        self._redis = redis.Redis.from_url(url)
        self._cas = self._redis.register_script(_CAS_LUA)

    def _k(self, key: str) -> str:
        return f"{self.prefix}s:{key}"

    def get(self, key: str) -> SessionRecord | None:
        raw = self._redis.hget(self._k(key), "data")
        return SessionRecord.from_json(raw) if raw else None

    def put(self, record: SessionRecord) -> SessionRecord | None:
        new = _stamped(record)
        ok = self._cas(keys=[self._k(record.key), f"{self.prefix}o:"],
                       args=[record.version, new.version, new.to_json(), new.owner or ""])
        return new if ok else None

    def delete(self, key: str) -> bool:
        k = self._k(key)
        owner = self._redis.hget(k, "owner")
        if owner:
            self._redis.srem(f"{self.prefix}o:{owner.decode()}", k)
        return self._redis.delete(k) > 0

    def owned_by(self, owner: str) -> list[str]:
        n = len(self._k(""))
        return sorted(m.decode()[n:] for m in self._redis.smembers(f"{self.prefix}o:{owner}"))

    def close(self) -> None:
        self._redis.close()


def make_store(url: str | None) -> SessionStore:
    """`memory://`, `sqlite:///path/to/file.db` (or a bare path), `redis://host:port/db`. None: memory."""
    if not url or url == "memory://":
        return MemoryStore()
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(url)
    url = url.removeprefix("sqlite://")
    return SQLiteStore(url)
