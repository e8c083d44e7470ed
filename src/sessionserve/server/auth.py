"""API keys and tenants.

Keys come from `--api-key` (tenant "default") or a JSON keys file mapping key
to tenant. Every comparison is constant-time over all keys, so response time
says nothing about how much of a guessed key was right; keys are never logged.
With no keys configured the server is open and everyone is tenant "default".
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path


class Auth:
    def __init__(self, keys: dict[str, str] | None = None) -> None:
        # Store digests, not keys: equal-length values for compare_digest, nothing to leak in a dump.
        self._keys = [(hashlib.sha256(k.encode()).digest(), tenant) for k, tenant in (keys or {}).items()]

    @classmethod
    def from_options(cls, api_keys: list[str] | None, keys_file: str | None) -> Auth:
        keys = {k: "default" for k in api_keys or []}
        if keys_file:
            data = json.loads(Path(keys_file).read_text())
            if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
                raise ValueError("the keys file must be a JSON object mapping API keys to tenant names")
            keys.update(data)
        return cls(keys)

    @property
    def is_open(self) -> bool:
        return not self._keys

    def tenant_for(self, authorization: str | None) -> str | None:
        """The tenant of a `Bearer <key>` header, or None if the key is missing or wrong."""
        if self.is_open:
            return "default"
        if not authorization or not authorization.startswith("Bearer "):
            return None
        digest = hashlib.sha256(authorization[len("Bearer "):].strip().encode()).digest()
        found = None
        for key_digest, tenant in self._keys:  # no early exit: constant time over the key list
            if hmac.compare_digest(digest, key_digest):
                found = tenant
        return found


def tenant_salt(tenant: str) -> bytes:
    """Prefix-cache salt of a tenant: no tenant can hit (or time) another's cached prefix."""
    return hashlib.sha256(b"tenant:" + tenant.encode()).digest()[:16]
