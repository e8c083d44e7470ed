"""What a residency policy sees and answers: parked sessions, tier room, measured costs; actions.

Shared by the policies (core/residency.py, core/predictive.py) and the session
manager that builds the views and carries out the actions.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from enum import Enum
from typing import NamedTuple, Protocol

from sessionserve.core.session import Residency
from sessionserve.core.wait_predictor import WaitPrediction
from sessionserve.types.kv_mover import Tier


class ParkedSession(NamedTuple):
    session_id: str
    residency: Residency
    num_blocks: int  # device blocks the KV occupies (or will, once restored)
    num_tokens: int  # computed tokens: what a drop would make us recompute
    parked_s: float
    predicted: WaitPrediction
    # Of num_blocks on device, those that other live sequences read too (a fork's children, a shared
    # prompt): they stay on device whatever happens to this session, so moving it does not free them.
    num_shared_blocks: int = 0

    @property
    def num_freed_blocks(self) -> int:
        """Device blocks that moving or dropping this session frees."""
        return self.num_blocks - self.num_shared_blocks


class MoveCosts(NamedTuple):
    """Measured costs, one way, in seconds."""

    host_s_per_block: float
    disk_s_per_block: float
    recompute_s_per_token: float


class ResidencyView(NamedTuple):
    now_s: float
    parked: tuple[ParkedSession, ...]
    num_device_blocks: int
    num_free_device_blocks: int
    # Blocks that queued requests need now and cannot get (0 when admission is not blocked).
    num_wanted_device_blocks: int
    num_free_host_blocks: int
    num_free_disk_blocks: int
    costs: MoveCosts
    # Optional, for policies that keep per-session state between views: how `parked` differs from an
    # earlier view's, as (that view's `parked`, entries new or changed since, ids of sessions gone since).
    # None: not known (a policy compares the two itself).
    delta: ViewDelta | None = None
    # The sessions in the admission door's working set, while a door holds turns (None: none does). The
    # others' next turns wait at the door (or run only on loan): under pressure their KV leaves first.
    members: AbstractSet[str] | None = None


class ViewDelta(NamedTuple):
    base: tuple[ParkedSession, ...]
    changed: tuple[ParkedSession, ...]
    gone: tuple[str, ...]


class ActionKind(Enum):
    OFFLOAD = "offload"
    DROP = "drop"
    PREFETCH = "prefetch"


class ResidencyAction(NamedTuple):
    kind: ActionKind
    session_id: str
    tier: Tier | None = None


class ResidencyPolicy(Protocol):
    name: str

    def decide(self, view: ResidencyView) -> tuple[ResidencyAction, ...]:
        """Actions for this moment. Must not act on sessions that are OFFLOADING or RESTORING."""
        ...

    def next_decision_s(self, view: ResidencyView) -> float | None:
        """For a view on which `decide` returns no action: the earliest time after `view.now_s` at
        which it could return one with only `now_s` moved forward; None if the clock alone never
        makes it act. Early is allowed (a wasted call), late is not: the engine skips `decide` until
        then while nothing else changes."""
        ...



def outside(view: ResidencyView, s: ParkedSession) -> bool:
    """Whether `s` is outside the admission door's working set: its KV is the first to leave under pressure."""
    return view.members is not None and s.session_id not in view.members


def pressure(view: ResidencyView) -> int:
    """Device blocks to free now for queued work."""
    return max(0, view.num_wanted_device_blocks - view.num_free_device_blocks)

