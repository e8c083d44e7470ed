"""The mover interface: copies a session's KV blocks between the device and a lower tier (`Tier`).

The real mover (`sessionserve.cache.mover.ThreadMover`) copies on a worker
thread (a copy stream on CUDA); the simulator's completes moves on its
virtual clock. The session manager only ever talks to this interface.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple, Protocol


class Tier(Enum):
    """A lower tier a parked session's KV can be moved to (the device is not one)."""

    HOST = "host"
    DISK = "disk"

    # Members are singletons compared by identity: hash them so too, in C (Enum's own __hash__ is Python
    # code, and tiers key the movers' per-tier counters, read on every engine step).
    __hash__ = object.__hash__


class MoveKind(Enum):
    OFFLOAD = "offload"
    RESTORE = "restore"


class MoveDone(NamedTuple):
    session_id: str
    kind: MoveKind
    tier: Tier
    ok: bool
    num_bytes: int
    seconds: float
    error: str | None = None  # "corrupt" | "io" | other, when not ok


class KVMover(Protocol):
    block_bytes: int

    def num_free_blocks(self, tier: Tier) -> int:
        """Blocks the tier can still take."""
        ...

    def offload(self, session_id: str, device_blocks: list[int], tier: Tier) -> bool:
        """Reserve room in `tier` and start copying `device_blocks` there.

        False (and nothing reserved) when the tier is full. The device blocks
        must stay allocated and unwritten until the matching MoveDone.
        """
        ...

    def restore(self, session_id: str, device_blocks: list[int]) -> None:
        """Start copying the session's stored copy into `device_blocks` (allocated by the caller).

        The stored copy is released when the restore completes.
        """
        ...

    def discard(self, session_id: str) -> None:
        """Release the session's stored copy (now, or when its in-flight move ends)."""
        ...

    def poll(self) -> list[MoveDone]:
        """Moves completed since the last poll. Never blocks."""
        ...

    def wait(self, timeout_s: float) -> None:
        """Block until some move completes or `timeout_s` passes (used when nothing else can run)."""
        ...


def int8_block_bytes(block_bytes: int, dtype_bytes: int, head_dim: int) -> int:
    """Bytes of a block of `block_bytes` (elements of `dtype_bytes` each) stored as int8 with one fp32 scale
    per token vector (one layer's K or V of one head: `head_dim` elements). The host tier and the
    simulator size an int8 tier with this."""
    numel = block_bytes // dtype_bytes
    return numel + numel // head_dim * 4
