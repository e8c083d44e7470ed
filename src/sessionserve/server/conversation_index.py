"""Find the session a request continues from its tokens alone (implicit sessions).

Clients of OpenAI-style APIs resend the whole conversation on every call and
rarely send a session id. A conversation's next prompt always starts with its
previous prompt (the chat template renders earlier messages the same way), so
each session is indexed under the chained hash of its latest prompt's full
blocks (the prefix cache's hash, salted per tenant). A new prompt is hashed
block by block once, and the longest block boundary that names a session is
the conversation it continues.

Only a session's *whole* latest prompt is indexed, never its shorter prefixes:
two conversations that share a long system prompt and tools do not match
each other; they branch, and share the common blocks through the prefix
cache. Pure: no engine, no clock. Cost per lookup: one hash per full block of
the prompt and one dict probe per block; no scan of the sessions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from sessionserve.cache.block_hash import extend_block_hashes


class ConversationIndex:
    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self._by_hash: dict[bytes, list[str]] = {}
        self._by_session: dict[str, tuple[bytes, int]] = {}  # key -> (hash, prompt length)

    def __len__(self) -> int:
        return len(self._by_session)

    def register(self, session_key: str, prompt_ids: Sequence[int], salt: bytes = b"") -> None:
        """Index `session_key` under its latest prompt (replacing what it was indexed under)."""
        self.forget(session_key)
        hashes = extend_block_hashes([], prompt_ids, self.block_size, salt)
        if not hashes:
            return  # shorter than one block: nothing safe to match on
        self._by_hash.setdefault(hashes[-1], []).append(session_key)
        self._by_session[session_key] = (hashes[-1], len(prompt_ids))

    def forget(self, session_key: str) -> None:
        entry = self._by_session.pop(session_key, None)
        if entry is None:
            return
        h = entry[0]
        keys = self._by_hash.get(h, [])
        if session_key in keys:
            keys.remove(session_key)
        if not keys:
            self._by_hash.pop(h, None)

    def candidates(self, prompt_ids: Sequence[int], salt: bytes = b"") -> Iterator[tuple[str, int]]:
        """(session key, length of its indexed prompt), longest match first.

        A match means the full blocks agree; the caller checks the indexed
        prompt's tail (the last partial block) against the session's tokens.
        Sessions indexed under the same prompt come most recently registered first.
        """
        hashes = extend_block_hashes([], prompt_ids, self.block_size, salt)
        for i in range(len(hashes) - 1, -1, -1):
            keys = self._by_hash.get(hashes[i])
            if keys:
                for key in reversed(list(keys)):
                    yield key, self._by_session[key][1]
