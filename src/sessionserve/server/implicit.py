"""Implicit sessions: a chat request without a session id continues the conversation it extends.

The conversation is found from the rendered prompt alone (`ConversationIndex`:
the chained hash of each session's latest prompt, salted per tenant). What a
match gives is the same as an explicit session id: the KV the session holds
(wherever the residency policy put it while the client ran its tools), its
wait predictor, parking after a reply that ends in tool calls, expiry.

- A prompt whose indexed conversation is running a turn right now (two
  sub-agents sent from the same context) starts a *fork*: a new session whose
  first turn reuses the shared blocks through the prefix cache.
- A prompt that shares only part of a conversation (the same system prompt
  and tools) matches nothing: a new session; the common blocks are shared the
  same way, and neither conversation ever continues the other.
- At most `max_sessions` implicit sessions are kept; opening one more closes
  the least recently used idle one. They never count against a tenant's limit
  of explicit sessions.

Everything here runs in the engine thread (inside a request's prepare step).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Sequence

from sessionserve.llm_engine import LLMEngine
from sessionserve.server.bridge import SessionState
from sessionserve.server.conversation_index import ConversationIndex

# Implicit session ids start with a character client-chosen ids cannot contain.
IMPLICIT_PREFIX = "~"


def is_implicit(session_id: str) -> bool:
    return session_id.startswith(IMPLICIT_PREFIX)


class ImplicitSessions:
    def __init__(self, block_size: int, max_sessions: int = 256) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self.index = ConversationIndex(block_size)
        self.max_sessions = max_sessions
        self._lru: OrderedDict[str, None] = OrderedDict()  # engine session keys, least recent first
        self.num_requests = 0  # requests without a session id
        self.num_hits = 0  # ... that continued a live session
        self.num_forks = 0  # ... that branched off a session busy with another turn
        self.num_opened = 0
        self.num_evicted = 0

    @property
    def num_open(self) -> int:
        return len(self._lru)

    def resolve(self, eng: LLMEngine, tenant: str, prompt: Sequence[int], salt: bytes) -> str:
        """`find` and `commit` in one: the session id (without tenant) this prompt's turn runs in."""
        sid, kind = self.find(eng, tenant, prompt, salt)
        self.commit(eng, tenant, sid, kind, prompt, salt)
        return sid

    def find(self, eng: LLMEngine, tenant: str, prompt: Sequence[int], salt: bytes) -> tuple[str, str]:
        """The session id (without tenant) this prompt continues, or a new one; and which: hit, fork or new.

        Changes nothing a retry would see differently: the index learns the prompt only in `commit`, once
        the turn was added (a turn refused while its session's KV moves between tiers finds the same).
        """
        busy = False
        for key, n in self.index.candidates(prompt, salt):
            session = eng.get_session(key)
            if session is None:  # expired or closed since it was indexed
                self._drop(key)
                continue
            if session.tenant != tenant or len(prompt) <= n or session.token_ids[:n] != list(prompt[:n]):
                continue
            if session.state is SessionState.RUNNING:
                busy = True
                continue
            return key.split("/", 1)[1], "hit"
        return f"{IMPLICIT_PREFIX}{uuid.uuid4().hex[:20]}", "fork" if busy else "new"

    def commit(self, eng: LLMEngine, tenant: str, sid: str, kind: str, prompt: Sequence[int], salt: bytes) -> None:
        """Index `prompt` as the latest of session `sid` and count the request; a new one may evict an idle one."""
        self.num_requests += 1
        if kind == "hit":
            self.num_hits += 1
        else:
            self.num_forks += kind == "fork"
            self.num_opened += 1
            self._make_room(eng)
        self._touch(f"{tenant}/{sid}", prompt, salt)

    def _touch(self, key: str, prompt: Sequence[int], salt: bytes) -> None:
        self.index.register(key, prompt, salt)
        self._lru[key] = None
        self._lru.move_to_end(key)

    def _drop(self, key: str) -> None:
        self.index.forget(key)
        self._lru.pop(key, None)

    def _make_room(self, eng: LLMEngine) -> None:
        """Close least recently used idle implicit sessions until one more fits."""
        for key in list(self._lru):
            if len(self._lru) < self.max_sessions:
                return
            session = eng.get_session(key)
            if session is None:
                self._drop(key)
            elif session.state is not SessionState.RUNNING:
                eng.close_session(key)
                self._drop(key)
                self.num_evicted += 1
