"""Stored Responses API responses: what `GET /v1/responses/{id}` returns and `previous_response_id` continues.

A record holds the response body, its own input items, the conversation it
added (its input as chat messages and its reply), the id of the response it
continued, and the session point it left behind (which session, where in it,
the digest of the conversation held there). A conversation is the chain of
records back to its first response; the latest chains are kept in memory.

Records are per tenant (another tenant's id is not found) and expire after a
TTL. Three stores, as for sessions: memory (tests), SQLite (the default, one
file or `:memory:`), Redis (`redis://`, many replicas).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sessionserve.server.turn.types import Continuation, SessionPoint

DEFAULT_TTL_S = 24 * 3600.0
MAX_CHAIN = 100_000  # responses walked back through previous_response_id at most
_CACHED_CHAINS = 512


@dataclass(frozen=True)
class StoredResponse:
    id: str
    tenant: str
    body: dict[str, Any]  # the Response object as returned
    input_items: list[dict[str, Any]]  # this request's own input items, as sent
    messages: list[dict[str, Any]]  # what this response added to the conversation (chat-shaped), reply last
    previous_id: str | None = None
    continuation: Continuation | None = None  # where its session stood after it
    created_s: float = field(default_factory=time.time)

    def to_json(self) -> str:
        d = asdict(self)
        return json.dumps(d, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> StoredResponse:
        d = json.loads(raw)
        cont = d.get("continuation")
        if cont is not None:
            d["continuation"] = Continuation(SessionPoint(**cont["point"]), cont["digest"])
        return cls(**d)


class ResponseStore(ABC):
    """Stored responses by (tenant, id). Thread-safe."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._chains: OrderedDict[tuple[str, str], list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    @abstractmethod
    def _get(self, key: str) -> str | None: ...

    @abstractmethod
    def _put(self, key: str, raw: str) -> None: ...

    @abstractmethod
    def _delete(self, key: str) -> bool: ...

    def close(self) -> None:
        """Release connections."""

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        raw = self._get(f"{tenant}/{response_id}")
        return StoredResponse.from_json(raw) if raw else None

    def put(self, record: StoredResponse) -> None:
        self._put(f"{record.tenant}/{record.id}", record.to_json())

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            self._chains.pop((tenant, response_id), None)
        return self._delete(f"{tenant}/{response_id}")

    def conversation(self, record: StoredResponse) -> list[dict[str, Any]] | None:
        """Every message of the conversation up to and including `record` (None if a link has expired)."""
        key = (record.tenant, record.id)
        with self._lock:
            cached = self._chains.get(key)
            if cached is not None:
                self._chains.move_to_end(key)
                return list(cached)
        parts = [record.messages]
        prev = record.previous_id
        while prev is not None:
            with self._lock:
                cached = self._chains.get((record.tenant, prev))
            if cached is not None:
                parts.append(cached)
                break
            earlier = self.get(record.tenant, prev)
            if earlier is None or len(parts) > MAX_CHAIN:
                return None
            parts.append(earlier.messages)
            prev = earlier.previous_id
        chain = [m for part in reversed(parts) for m in part]
        with self._lock:
            self._chains[key] = chain
            while len(self._chains) > _CACHED_CHAINS:
                self._chains.popitem(last=False)
        return list(chain)


class MemoryResponseStore(ResponseStore):
    def __init__(self, ttl_s: float = DEFAULT_TTL_S) -> None:
        super().__init__(ttl_s)
        self._data: dict[str, tuple[float, str]] = {}

    def _get(self, key: str) -> str | None:
        with self._lock:
            entry = self._data.get(key)
            if entry is None or entry[0] < time.time():
                self._data.pop(key, None)
                return None
            return entry[1]

    def _put(self, key: str, raw: str) -> None:
        now = time.time()
        with self._lock:
            self._data[key] = (now + self.ttl_s, raw)
            if len(self._data) % 1024 == 0:  # sweep what expired, now and then
                self._data = {k: v for k, v in self._data.items() if v[0] >= now}

    def _delete(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None


class SQLiteResponseStore(ResponseStore):
    """One SQLite file (or `:memory:`), with expiry times; expired rows are swept as new ones are written."""

    def __init__(self, path: str, ttl_s: float = DEFAULT_TTL_S) -> None:
        super().__init__(ttl_s)
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        # NOTE: one connection behind a lock: requests touch the store once per turn, never on a hot path.
        self._conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        self._db_lock = threading.Lock()
        self._num_puts = 0
        with self._db_lock:
            if path != ":memory:":
                self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("CREATE TABLE IF NOT EXISTS responses (key TEXT PRIMARY KEY, expires REAL NOT NULL, "
                               "data TEXT NOT NULL)")

    def _get(self, key: str) -> str | None:
        with self._db_lock:
            row = self._conn.execute("SELECT data FROM responses WHERE key = ? AND expires >= ?",
                                     (key, time.time())).fetchone()
        return row[0] if row else None

    def _put(self, key: str, raw: str) -> None:
        now = time.time()
        with self._db_lock:
            self._conn.execute("INSERT OR REPLACE INTO responses (key, expires, data) VALUES (?, ?, ?)",
                               (key, now + self.ttl_s, raw))
            self._num_puts += 1
            if self._num_puts % 256 == 0:
                self._conn.execute("DELETE FROM responses WHERE expires < ?", (now,))

    def _delete(self, key: str) -> bool:
        with self._db_lock:
            return self._conn.execute("DELETE FROM responses WHERE key = ?", (key,)).rowcount > 0

    def close(self) -> None:
        with self._db_lock:
            self._conn.close()


class RedisResponseStore(ResponseStore):
    """Records as Redis strings with Redis's own expiry (`<prefix>r:<tenant>/<id>`)."""

    def __init__(self, url: str, ttl_s: float = DEFAULT_TTL_S, prefix: str = "sessionserve:") -> None:
        super().__init__(ttl_s)
        import redis  # optional dependency: `pip install sessionserve[ray]`

        self._redis = redis.Redis.from_url(url)
        self._prefix = prefix

    def _get(self, key: str) -> str | None:
        raw = self._redis.get(f"{self._prefix}r:{key}")
        return raw.decode() if raw else None

    def _put(self, key: str, raw: str) -> None:
        self._redis.set(f"{self._prefix}r:{key}", raw, ex=max(1, int(self.ttl_s)))

    def _delete(self, key: str) -> bool:
        return self._redis.delete(f"{self._prefix}r:{key}") > 0

    def close(self) -> None:
        self._redis.close()


def make_response_store(url: str | None, ttl_s: float = DEFAULT_TTL_S) -> ResponseStore:
    """`memory://`, `sqlite:///path/to/file.db` (or a bare path; None: SQLite in memory), `redis://host:port/db`."""
    if url == "memory://":
        return MemoryResponseStore(ttl_s)
    if url and url.startswith(("redis://", "rediss://", "unix://")):
        return RedisResponseStore(url, ttl_s)
    return SQLiteResponseStore((url or ":memory:").removeprefix("sqlite://"), ttl_s)
