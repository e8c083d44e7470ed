"""An agent session as the engine sees it: its tokens, where its KV lives, what it waits on."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

from sessionserve.types.sequence import Program, Sequence, SessionBlocks

if TYPE_CHECKING:
    from sessionserve.types.kv_mover import Tier


class SessionState(Enum):
    IDLE = "idle"  # opened, no turn yet
    RUNNING = "running"  # a turn is queued or generating
    PARKED = "parked"  # between turns, e.g. waiting on a tool
    CLOSED = "closed"


class Residency(Enum):
    """Where a parked session's KV is. Transitions are driven by residency actions and the mover."""

    NONE = "none"  # nothing held (new session, or dropped: the next turn recomputes)
    DEVICE = "device"
    OFFLOADING = "offloading"  # device copy still held while the mover writes host/disk
    HOST = "host"
    DISK = "disk"
    RESTORING = "restoring"  # device blocks allocated, mover copying back


@dataclass(slots=True)
class SessionStats:
    """Per-session counters (tokens and bytes), exported with the session."""

    num_turns: int = 0
    num_prompt_tokens: int = 0  # tokens sent by the client across turns
    num_computed_prompt_tokens: int = 0  # prompt tokens actually prefilled
    num_recompute_tokens: int = 0  # tokens prefilled again that the session had computed before
    num_offloaded_bytes: int = 0
    num_restored_bytes: int = 0
    num_prefetch_hits: int = 0  # resumed with KV already on device thanks to a prefetch
    num_prefetch_late: int = 0  # resumed while the prefetch was still copying
    num_restore_misses: int = 0  # resumed with KV off device and no prefetch started
    restore_blocked_s: float = 0.0  # time turns waited for KV to come back
    total_wait_s: float = 0.0  # time parked


class WaitingTurn(NamedTuple):
    """A session's turn that waits for the session's KV to come back from a lower tier, and since when."""

    seq: Sequence
    since_s: float


@dataclass(eq=False, slots=True)
class Session:
    """A conversation whose KV survives between turns.

    Invariants: `token_ids[:num_computed_tokens]` have KV in the tier given by
    `residency` (none when NONE); the KV manager holds the device blocks
    under `kv_key` while residency is DEVICE, OFFLOADING or RESTORING.
    """

    session_id: str
    tenant: str = ""
    priority: str = "interactive"
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    state: SessionState = SessionState.IDLE
    residency: Residency = Residency.NONE
    stored_tier: Tier | None = None  # where the off-device copy is, when there is one
    opened_s: float = 0.0
    last_active_s: float = 0.0
    parked_s: float | None = None
    # What the session waits on while parked: tool names and the client's hint, if any.
    waiting_tools: tuple[str, ...] = ()
    wait_hint_s: float | None = None
    predicted_resume_s: float | None = None
    is_prefetched: bool = False  # current device copy came from a prefetch (for hit accounting)
    request_id: str | None = None  # the running turn
    waiting_turn: WaitingTurn | None = None  # the running turn, while it waits for the KV to come back
    # Computed tokens the last drop lost (or the client's rewrite kept of them): the next turn's prefill
    # of them, less what the prefix cache still held, is counted as recompute.
    num_dropped_tokens: int = 0
    stats: SessionStats = field(default_factory=SessionStats)
    # Service its turns received (tokens computed), for least-attained-service scheduling.
    program: Program = field(default_factory=Program)

    @property
    def kv_key(self) -> SessionBlocks:
        """Key of the session's own block table in the KV manager while parked."""
        return SessionBlocks(self.session_id)
