"""Chained hashes of full KV blocks: the key of the prefix cache.

A block's hash covers its tokens and its parent's hash, so equal hashes mean
equal whole prefixes. A salt (per tenant) enters the first block and so every
block after it: two tenants never share, or can time, each other's prefix.
Hashes are stable across processes (blake2b, not Python's `hash`), so a router
or another replica can compute them too.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_DIGEST_BYTES = 16


def hash_block(parent: bytes | None, tokens: Sequence[int], salt: bytes = b"") -> bytes:
    """Hash of one full block given its parent's hash (None for the first block)."""
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    h.update(parent if parent is not None else b"root:" + salt)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        salt: bytes = b"", limit: int | None = None) -> list[bytes]:
    """Append the hashes of full blocks of `token_ids` not yet in `hashes` (mutates and returns it).

    `limit` caps the number of tokens considered (e.g. only computed ones).
    """
    num_tokens = len(token_ids) if limit is None else min(limit, len(token_ids))
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], salt))
    return hashes
