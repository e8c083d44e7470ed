"""Residency policies: what to do with the KV of sessions parked between turns.

Pure functions of a `ResidencyView` (parked sessions, predicted waits, tier
capacities, measured costs) returning actions; the session manager carries
them out through the mover. One interface, chosen by name:

  discard      release the KV at every park (a stateless server; only the
               prefix cache may still hold some of it) — the baseline
  keep         hold on device until resume; under memory pressure drop the
               longest-parked first (nothing else can make room)
  ttl          hold for a time-to-live derived from the predicted wait, then
               drop (after Continuum)
  least-waste  per session, keep / swap to host / drop by the memory-time
               each wastes (after InferCept)
  predictive   ours: keep short predicted waits in place; move longer ones to
               host (or disk, by size and room) as soon as they park once the
               device is more than half used (below that, holding costs nothing), and
               under pressure the farthest predicted next use first; prefetch
               so the KV is back just before the predicted resume; re-offload
               when a prediction proves wrong (core/predictive.py)

The view and the actions are in core/residency_view.py.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from sessionserve.core.predictive import PredictivePolicy
from sessionserve.core.residency_view import (
    ActionKind,
    MoveCosts,
    ParkedSession,
    ResidencyAction,
    ResidencyPolicy,
    ResidencyView,
    ViewDelta,
    outside,
    pressure,
)
from sessionserve.core.session import Residency
from sessionserve.types.kv_mover import Tier

__all__ = ["POLICIES", "ActionKind", "DiscardPolicy", "KeepPolicy", "LeastWastePolicy", "MoveCosts",
           "ParkedSession", "PredictivePolicy", "ResidencyAction", "ResidencyPolicy", "ResidencyView",
           "TTLPolicy", "ViewDelta", "make_policy"]


def _first_after(now_s: float, times: list[float]) -> float | None:
    later = [t for t in times if t > now_s]
    return min(later) if later else None


def _drop_until(candidates: list[ParkedSession], need: int, view: ResidencyView) -> list[ResidencyAction]:
    """Drop candidates in order until `need` blocks are freed, those outside the admission door's working set
    first. Sessions all of whose blocks others read go last: dropping one alone frees nothing (only a whole
    group of parked sessions sharing blocks does)."""
    actions = []
    for s in sorted(candidates, key=lambda s: (s.num_freed_blocks <= 0, not outside(view, s))):
        if need <= 0:
            break
        actions.append(ResidencyAction(ActionKind.DROP, s.session_id))
        need -= s.num_freed_blocks
    return actions


def _on_device(view: ResidencyView) -> list[ParkedSession]:
    return [s for s in view.parked if s.residency is Residency.DEVICE]



@dataclass(frozen=True)
class DiscardPolicy:
    name: str = "discard"

    def decide(self, view: ResidencyView) -> tuple[ResidencyAction, ...]:
        return tuple(ResidencyAction(ActionKind.DROP, s.session_id) for s in _on_device(view))

    def next_decision_s(self, view: ResidencyView) -> float | None:
        return None


@dataclass(frozen=True)
class KeepPolicy:
    name: str = "keep"

    def decide(self, view: ResidencyView) -> tuple[ResidencyAction, ...]:
        oldest_first = sorted(_on_device(view), key=lambda s: s.parked_s)
        return tuple(_drop_until(oldest_first, pressure(view), view))

    def next_decision_s(self, view: ResidencyView) -> float | None:
        return None


@dataclass(frozen=True)
class TTLPolicy:
    """Keep for ttl = factor x predicted p50 (clamped), then drop."""

    name: str = "ttl"
    factor: float = 1.5
    min_ttl_s: float = 0.5
    max_ttl_s: float = 120.0

    def ttl_s(self, s: ParkedSession) -> float:
        return min(self.max_ttl_s, max(self.min_ttl_s, self.factor * s.predicted.p50_s))

    def decide(self, view: ResidencyView) -> tuple[ResidencyAction, ...]:
        on_device = _on_device(view)
        expired = [s for s in on_device if view.now_s - s.parked_s >= self.ttl_s(s)]
        actions = [ResidencyAction(ActionKind.DROP, s.session_id) for s in expired]
        freed = sum(s.num_freed_blocks for s in expired)
        rest = sorted((s for s in on_device if s not in expired),
                      key=lambda s: s.parked_s + self.ttl_s(s))  # closest to expiry first
        actions += _drop_until(rest, pressure(view) - freed, view)
        return tuple(actions)

    def next_decision_s(self, view: ResidencyView) -> float | None:
        return _first_after(view.now_s, [s.parked_s + self.ttl_s(s) for s in _on_device(view)])


@dataclass(frozen=True)
class LeastWastePolicy:
    """Per session: the cheapest of keep, swap to host, drop, in memory-time (block-seconds)."""

    name: str = "least-waste"

    def waste(self, s: ParkedSession, view: ResidencyView) -> dict[str, float]:
        c = view.costs
        used = view.num_device_blocks - view.num_free_device_blocks
        recompute_s = c.recompute_s_per_token * s.num_tokens
        out = {
            # Blocks other sequences read stay on device anyway: keeping costs only the session's own.
            "keep": s.num_freed_blocks * s.predicted.p50_s,
            # Recompute holds the session's blocks while prefilling and stalls the running batch.
            "drop": s.num_blocks * recompute_s + used * recompute_s,
        }
        if view.num_free_host_blocks >= s.num_blocks:
            out["swap"] = s.num_blocks * 2 * c.host_s_per_block * s.num_blocks
        return out

    def decide(self, view: ResidencyView) -> tuple[ResidencyAction, ...]:
        actions: list[ResidencyAction] = []
        need = pressure(view)
        host_free = view.num_free_host_blocks
        kept: list[ParkedSession] = []
        for s in _on_device(view):
            w = self.waste(s, view)
            choice = min(w, key=w.__getitem__)
            if choice == "swap" and host_free >= s.num_blocks:
                actions.append(ResidencyAction(ActionKind.OFFLOAD, s.session_id, Tier.HOST))
                host_free -= s.num_blocks
                need -= s.num_freed_blocks
            elif choice == "drop":
                actions.append(ResidencyAction(ActionKind.DROP, s.session_id))
                need -= s.num_freed_blocks
            else:
                kept.append(s)
        # Under pressure, the kept sessions that waste least by dropping go first.
        kept.sort(key=lambda s: self.waste(s, view)["drop"])
        actions += _drop_until(kept, need, view)
        return tuple(actions)

    def next_decision_s(self, view: ResidencyView) -> float | None:
        return None  # the predicted p50, costs and room: none moves with the clock



POLICIES: dict[str, type] = {
    "discard": DiscardPolicy,
    "keep": KeepPolicy,
    "ttl": TTLPolicy,
    "least-waste": LeastWastePolicy,
    "predictive": PredictivePolicy,
}


def make_policy(name: str, indexed: bool = False) -> ResidencyPolicy:
    """The policy called `name`. `indexed`: decide from per-session states kept from view to view where
    the policy has such an index (the same decisions, faster with many parked sessions: the simulator's
    choice)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown residency policy {name!r}; choose from {sorted(POLICIES)}") from None
    return cls(indexed=True) if indexed and "indexed" in {f.name for f in fields(cls)} else cls()
