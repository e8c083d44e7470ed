"""The predictive residency policy (ours), and the index the simulator turns on to decide it faster.

Keep short predicted waits in place; on a device more than half used, move
longer ones to host (or disk, by size and room) as soon as they park; under
pressure, the sessions outside the admission door's working set first, then
the farthest predicted next use; prefetch so the KV is back just before the
predicted resume. Pure: a function of the `ResidencyView`.

`PredictivePolicy.decide` is the policy written plainly, from the view alone:
read it to know what the policy decides. With `indexed=True` (the simulator's
choice, where thousands of parked sessions are decided on every virtual step)
the same decisions come from `_PredictiveIndex`, which keeps per-session
states from view to view in time proportional to what changed; a property
test holds the two equal.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

from sessionserve.core.residency_view import (
    ActionKind,
    MoveCosts,
    ParkedSession,
    ResidencyAction,
    ResidencyView,
    outside,
    pressure,
)
from sessionserve.core.session import Residency
from sessionserve.types.kv_mover import Tier


def _remaining_after(p50_s: float, p90_s: float, waited_s: float) -> float:
    """Expected time until resume after waiting `waited_s`, for a wait predicted at (p50, p90)."""
    if waited_s < p50_s:
        return p50_s - waited_s
    if waited_s < p90_s:
        return p90_s - waited_s
    return waited_s  # past the 90th percentile of a heavy tail: expect about as long again


@lru_cache(maxsize=1 << 14)
def _above_pieces(p50_s: float, p90_s: float, threshold_s: float) -> tuple[tuple[float, bool], ...]:
    """(start, is the expected remaining wait above `threshold_s` from there) for each piece of the
    waited-time axis, the first from -inf.

    `_remaining_after` is piecewise linear in the time waited: it falls from p50 to 0 over [0, p50),
    from p90 - p50 over [p50, p90), then grows as the wait itself; so the comparison can only change
    at a piece's end or where a piece meets the threshold. Sessions share predictions and sizes, so
    the table is computed once per (p50, p90, threshold).
    """
    starts = sorted({w for w in (p50_s - threshold_s, p50_s, p90_s - threshold_s, p90_s, threshold_s)})
    # The comparison is constant inside a piece: test it in the middle (at the boundary itself rounding
    # could give the piece before).
    out = [(-math.inf, _remaining_after(p50_s, p90_s, starts[0] - 1.0) > threshold_s)]
    for w, w_next in zip(starts, [*starts[1:], starts[-1] + 2.0]):
        out.append((w, _remaining_after(p50_s, p90_s, (w + w_next) / 2) > threshold_s))
    return tuple(out)


def _above_until(s: ParkedSession, now_s: float, threshold_s: float,
                 acts_when: bool) -> tuple[bool, float | None, float | None]:
    """Whether PredictivePolicy's expected remaining wait is above `threshold_s` at `now_s`, when that
    next changes (None: never), and when it next turns to `acts_when` (the value on which the policy
    acts for this session; None: never). Read off the pieces, boundaries included: a decision asked
    for at a returned time sees the new value."""
    pieces = _above_pieces(s.predicted.p50_s, s.predicted.p90_s, threshold_s)
    parked_s = s.parked_s
    k = 0
    while k + 1 < len(pieces) and parked_s + pieces[k + 1][0] <= now_s:
        k += 1
    above = pieces[k][1]
    until_s = acts_s = None
    prev = above
    for w, after in pieces[k + 1:]:
        if after != prev:
            if until_s is None:
                until_s = parked_s + w
            if after == acts_when:
                acts_s = parked_s + w
                break
            prev = after
    return above, until_s, acts_s


class _Memo(NamedTuple):
    """A session's state as PredictivePolicy last computed it (see `_PredictiveIndex`): valid for this
    entry and the costs it was computed with, until `until_s`."""

    entry: ParkedSession
    above: bool
    until_s: float | None
    acts_s: float | None  # when the clock alone next makes this session one to act on



class _PredictiveIndex:
    """PredictivePolicy's per-session states, kept up to date from view to view in time proportional to
    what changed: sessions whose entry is new (told apart by identity: the session manager builds a new
    entry when a session changes) and sessions whose state the clock flipped since the last view.

    Per session: whether its expected remaining wait is above its threshold (on device: long enough to
    leave; off device: not yet due for its prefetch), until when that holds, and when the clock alone
    next makes it one to act on. Sessions to act on without memory pressure (long waits on device, due
    ones off it) are kept apart, so a view with none costs no walk over the parked sessions.
    """

    __slots__ = ("acts_off", "acts_on", "costs", "due", "flips", "ids", "long", "memo", "now_s", "parked", "seq")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.memo: dict[str, _Memo] = {}
        self.ids: dict[int, str] = {}  # id of each entry in `memo` (held there, so never reused) -> session
        self.parked: tuple[ParkedSession, ...] | None = None  # the view's sessions as of the last sync
        self.now_s = -math.inf
        self.costs: MoveCosts | None = None
        self.long: set[str] = set()  # on device, frees blocks, above its threshold
        self.due: set[str] = set()  # off device, below its lead time
        self.flips: list[tuple[float, int, _Memo]] = []  # (until_s, seq, memo): a state to compute again
        # (acts_s, seq, memo) of sessions on device (turning long) and off it (coming due)
        self.acts_on: list[tuple[float, int, _Memo]] = []
        self.acts_off: list[tuple[float, int, _Memo]] = []
        self.seq = 0

    def sync(self, policy: PredictivePolicy, view: ResidencyView) -> None:
        now, parked = view.now_s, view.parked
        if parked is self.parked and now == self.now_s and view.costs == self.costs:
            return  # (the view just decided on, asked for its next decision time)
        if view.costs != self.costs or now < self.now_s:  # thresholds moved, or a view from the past
            self.reset()
            self.costs = view.costs
        if parked is not self.parked:
            delta = view.delta
            if delta is not None and delta.base is self.parked:
                for sid in delta.gone:
                    self._drop(sid)
                for s in delta.changed:
                    self._drop(s.session_id)
                    self._add(policy, s, now)
            else:
                cur = dict(zip(map(id, parked), parked))
                ids = self.ids
                for gone in ids.keys() - cur.keys():
                    self._drop(ids[gone])
                for key in cur.keys() - ids.keys():  # (a session's earlier entry is among the gone)
                    self._add(policy, cur[key], now)
            self.parked = parked
        flips, memo = self.flips, self.memo
        while flips and flips[0][0] <= now:
            m = heapq.heappop(flips)[2]
            if memo.get(m.entry.session_id) is m:
                self._add(policy, m.entry, now)
        self.now_s = now
        if len(flips) + len(self.acts_on) + len(self.acts_off) > 4 * len(memo) + 64:  # stale heap items
            self.flips, self.acts_on, self.acts_off = (
                self._live(flips), self._live(self.acts_on), self._live(self.acts_off))

    def _live(self, heap: list[tuple[float, int, _Memo]]) -> list[tuple[float, int, _Memo]]:
        memo = self.memo
        out = [x for x in heap if memo.get(x[2].entry.session_id) is x[2]]
        heapq.heapify(out)
        return out

    def next_act_s(self, on_device: bool) -> float | None:
        """The earliest time a session comes due off device, or (`on_device`) turns long on it."""
        memo, out = self.memo, None
        for acts in ((self.acts_off, self.acts_on) if on_device else (self.acts_off,)):
            while acts and memo.get(acts[0][2].entry.session_id) is not acts[0][2]:
                heapq.heappop(acts)
            if acts and (out is None or acts[0][0] < out):
                out = acts[0][0]
        return out

    def _drop(self, sid: str) -> None:
        m = self.memo.pop(sid, None)
        if m is not None:
            self.ids.pop(id(m.entry), None)
            self.long.discard(sid)
            self.due.discard(sid)

    def _add(self, policy: PredictivePolicy, s: ParkedSession, now_s: float) -> None:
        sid, res, c = s.session_id, s.residency, self.costs
        self.long.discard(sid)
        self.due.discard(sid)
        if res is Residency.DEVICE:
            above, until_s, acts_s = _above_until(s, now_s, policy.keep_threshold_s(s, c), True)
            if s.num_freed_blocks <= 0:
                acts_s = None  # moving it frees nothing: only pressure acts on it
            elif above:
                self.long.add(sid)
        elif res is Residency.HOST or res is Residency.DISK:
            above, until_s, acts_s = _above_until(s, now_s, policy.lead_s(s, c), False)
            if not above:
                self.due.add(sid)
        else:  # moving
            above, until_s, acts_s = False, None, None
        m = _Memo(s, above, until_s, acts_s)
        self.memo[sid] = m
        self.ids[id(s)] = sid
        self.seq += 1
        if until_s is not None:
            heapq.heappush(self.flips, (until_s, self.seq, m))
        if acts_s is not None:
            heapq.heappush(self.acts_on if res is Residency.DEVICE else self.acts_off, (acts_s, self.seq, m))


@dataclass(frozen=True)
class PredictivePolicy:
    """Belady-like: the session whose next use is predicted farthest leaves the device first."""

    name: str = "predictive"
    # Keep this share of device blocks free for running and arriving work; below
    # it, parked sessions are moved off proactively.
    low_watermark: float = 0.10
    # Start a prefetch this many restore-times before the predicted resume.
    prefetch_lead: float = 2.0
    # Sessions larger than this share of the host tier's free room go to disk.
    host_share: float = 0.5
    # A wait shorter than this many host round trips (and this floor) stays on device:
    # moving it out and back would cost more than holding it.
    keep_round_trips: float = 4.0
    keep_floor_s: float = 0.25
    # Long waits leave at once only while the device is more than this share used: below it, holding
    # them costs nobody anything, and a move out and back risks a late restore on the resume.
    demote_above_usage: float = 0.5
    # Decide from per-session states kept from view to view (`_PredictiveIndex`) rather than afresh: the
    # same decisions in time proportional to what changed. The simulator turns it on.
    indexed: bool = False
    # The sessions' states as of the last view, when indexed (a cache: any view gets the plain answer).
    _index: _PredictiveIndex = field(default_factory=_PredictiveIndex, init=False, repr=False, compare=False)

    def remaining_s(self, s: ParkedSession, now_s: float) -> float:
        """Expected time until resume, given how long it has already waited."""
        return _remaining_after(s.predicted.p50_s, s.predicted.p90_s, now_s - s.parked_s)

    def decide(self, view: ResidencyView) -> tuple[ResidencyAction, ...]:
        """A session on device is *long* when its expected remaining wait exceeds `keep_threshold_s` (a
        few host round trips of its size): moving it out and back costs less than holding it. One off
        device is *due* when its expected remaining wait is below `lead_s` (a few restore times). Under
        pressure (queued work lacks blocks, or free blocks are below the watermark) sessions on device
        leave, those outside the admission door's working set first, then farthest next use first, to host
        when the round trip beats the wait, else to disk when a restore beats recomputing, else host if it
        fits, else they are dropped; without pressure only long ones leave, to host, and only on a device
        more than `demote_above_usage` used. Then due sessions come back, soonest first, into the room above
        the watermark."""
        if self.indexed:
            return self._decide_indexed(view)
        c, now = view.costs, view.now_s
        reserve, need = self._reserve_and_need(view)
        on_device = [(i, s) for i, s in enumerate(view.parked) if s.residency is Residency.DEVICE]
        if need > 0:
            # Sessions whose blocks all stay (others read them) last; those outside the admission door's
            # working set first (their next turn waits at the door); then farthest next use; then view order.
            order = sorted(on_device, key=lambda x: (x[1].num_freed_blocks <= 0, not outside(view, x[1]),
                                                     -self.remaining_s(x[1], now), x[0]))
        elif self._demotes(view):
            order = sorted(((i, s) for i, s in on_device if s.num_freed_blocks > 0 and self.is_long(s, now, c)),
                           key=lambda x: (not outside(view, x[1]), -self.remaining_s(x[1], now), x[0]))
        else:
            order = []
        actions: list[ResidencyAction] = []
        host_free, disk_free = view.num_free_host_blocks, view.num_free_disk_blocks
        for _, s in order:
            if need <= 0:
                if s.num_freed_blocks > 0 and self.is_long(s, now, c) and host_free >= s.num_blocks:
                    actions.append(ResidencyAction(ActionKind.OFFLOAD, s.session_id, Tier.HOST))
                    host_free -= s.num_blocks
                continue
            action = self.leave(s, self.remaining_s(s, now), host_free, disk_free, c)
            actions.append(action)
            host_free -= s.num_blocks if action.tier is Tier.HOST else 0
            disk_free -= s.num_blocks if action.tier is Tier.DISK else 0
            need -= s.num_freed_blocks
        due = sorted((self.remaining_s(s, now), i, s) for i, s in enumerate(view.parked)
                     if s.residency in (Residency.HOST, Residency.DISK) and self.is_due(s, now, c))
        return (*actions, *self._prefetch(view, reserve, (s for _, _, s in due)))

    def is_long(self, s: ParkedSession, now_s: float, c: MoveCosts) -> bool:
        """On device, and its expected remaining wait is above `keep_threshold_s` (read as `_above_until`
        reads it: a decision asked for at the time it changes sees the new value)."""
        return _above_until(s, now_s, self.keep_threshold_s(s, c), True)[0]

    def is_due(self, s: ParkedSession, now_s: float, c: MoveCosts) -> bool:
        """Off device, and its expected remaining wait is at most `lead_s`: time to prefetch."""
        return not _above_until(s, now_s, self.lead_s(s, c), False)[0]

    def _decide_indexed(self, view: ResidencyView) -> tuple[ResidencyAction, ...]:
        """`decide`, from the index's per-session states."""
        c, now = view.costs, view.now_s
        reserve, need = self._reserve_and_need(view)
        actions: list[ResidencyAction] = []
        host_free, disk_free = view.num_free_host_blocks, view.num_free_disk_blocks
        index = self._index
        index.sync(self, view)
        memo, parked = index.memo, view.parked

        # Demote: farthest predicted next use first. On a device more than half used, long waits
        # leave at once (NOTE: waiting for pressure means the next prefill finds no room and
        # preempts running work, whose recompute costs more than the move); short ones only while
        # memory is short.
        # Sessions all of whose blocks others read (a fork's running children) go last and only under
        # pressure: moving one frees nothing on its own.
        # Without pressure only long waits act (ties in view order), and only on a device more than
        # `demote_above_usage` used: the index holds them apart.
        if need > 0:
            candidates = [(s.num_freed_blocks <= 0, not outside(view, s), -self.remaining_s(s, now), i, s,
                           memo[s.session_id].above) for i, s in enumerate(parked) if s.residency is Residency.DEVICE]
        elif self._demotes(view):
            candidates = [(False, not outside(view, s), -self.remaining_s(s, now), parked.index(s), s, True)
                          for s in (memo[sid].entry for sid in index.long)]
        else:
            candidates = []
        for _, _, neg_remaining, _, s, is_long in sorted(candidates):
            if s.num_freed_blocks <= 0 and need <= 0:
                continue
            if need <= 0 and not is_long:
                continue  # (not break: the threshold grows with the session's size)
            if need <= 0:
                if host_free >= s.num_blocks:
                    actions.append(ResidencyAction(ActionKind.OFFLOAD, s.session_id, Tier.HOST))
                    host_free -= s.num_blocks
                continue
            action = self.leave(s, -neg_remaining, host_free, disk_free, c)
            actions.append(action)
            host_free -= s.num_blocks if action.tier is Tier.HOST else 0
            disk_free -= s.num_blocks if action.tier is Tier.DISK else 0
            need -= s.num_freed_blocks

        # Prefetch: soonest predicted resume first, into room above the watermark.
        due = sorted((self.remaining_s(s, now), parked.index(s), s) for s in (memo[sid].entry for sid in index.due))
        return (*actions, *self._prefetch(view, reserve, (s for _, _, s in due)))

    def _reserve_and_need(self, view: ResidencyView) -> tuple[int, int]:
        """Blocks kept free for arriving work, and how many blocks the device must free now."""
        reserve = int(self.low_watermark * view.num_device_blocks)
        need = pressure(view) + max(0, reserve - view.num_free_device_blocks)
        if need > 0:  # moves out already under way free their blocks shortly: no second eviction for them
            need -= sum(s.num_freed_blocks for s in view.parked if s.residency is Residency.OFFLOADING)
        return reserve, need

    def _prefetch(self, view: ResidencyView, reserve: int, due: Iterable[ParkedSession]) -> list[ResidencyAction]:
        """Prefetches of the `due` sessions, in order, each that fits the room left above the watermark."""
        room = view.num_free_device_blocks - reserve - pressure(view)
        actions = []
        for s in due:
            if s.num_blocks <= room:
                actions.append(ResidencyAction(ActionKind.PREFETCH, s.session_id))
                room -= s.num_blocks
        return actions

    def leave(self, s: ParkedSession, remaining_s: float, host_free: int, disk_free: int,
              c: MoveCosts) -> ResidencyAction:
        """Where a session leaving the device under pressure goes: the host when it has room (and the session
        is not most of it) and the round trip beats the expected wait; else disk when a restore beats
        recomputing it; else the host if it fits at all; else it is dropped."""
        if host_free >= s.num_blocks and s.num_blocks <= max(1, self.host_share * host_free) \
                and 2 * c.host_s_per_block * s.num_blocks < remaining_s:
            return ResidencyAction(ActionKind.OFFLOAD, s.session_id, Tier.HOST)
        if disk_free >= s.num_blocks and \
                2 * c.disk_s_per_block * s.num_blocks < 4 * c.recompute_s_per_token * s.num_tokens:
            return ResidencyAction(ActionKind.OFFLOAD, s.session_id, Tier.DISK)
        if host_free >= s.num_blocks:
            return ResidencyAction(ActionKind.OFFLOAD, s.session_id, Tier.HOST)
        return ResidencyAction(ActionKind.DROP, s.session_id)

    def _demotes(self, view: ResidencyView) -> bool:
        """Whether long waits leave the device without pressure: it is more than `demote_above_usage` used."""
        return view.num_device_blocks - view.num_free_device_blocks > self.demote_above_usage * view.num_device_blocks

    def keep_threshold_s(self, s: ParkedSession, c: MoveCosts) -> float:
        """A predicted remaining wait above this leaves the device even without memory pressure."""
        return max(self.keep_floor_s, self.keep_round_trips * 2 * c.host_s_per_block * s.num_blocks)

    def lead_s(self, s: ParkedSession, c: MoveCosts) -> float:
        """Prefetch once the predicted remaining wait is below this."""
        per_block = c.host_s_per_block if s.residency is Residency.HOST else c.disk_s_per_block
        return self.prefetch_lead * per_block * s.num_blocks + 0.05

    def next_decision_s(self, view: ResidencyView) -> float | None:
        if pressure(view) > 0 or view.num_free_device_blocks < int(self.low_watermark * view.num_device_blocks):
            return view.now_s
        # With no action now, every long device session lacks host room (or the device is not used
        # enough for them to leave) and every due one lacks device room, each on its own: that stays so
        # in any order until the clock makes another session one to act on (a wait on device turning
        # long, where they leave; one off device coming due).
        demotes = self._demotes(view)
        if self.indexed:
            self._index.sync(self, view)
            return self._index.next_act_s(on_device=demotes)
        c, now, out = view.costs, view.now_s, None
        for s in view.parked:
            if s.residency is Residency.DEVICE and demotes and s.num_freed_blocks > 0:
                acts_s = _above_until(s, now, self.keep_threshold_s(s, c), True)[2]
            elif s.residency is Residency.HOST or s.residency is Residency.DISK:
                acts_s = _above_until(s, now, self.lead_s(s, c), False)[2]
            else:
                continue
            if acts_s is not None and (out is None or acts_s < out):
                out = acts_s
        return out
