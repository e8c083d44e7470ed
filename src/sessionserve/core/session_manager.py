"""Sessions in the engine: turns, parking, residency actions, restores, expiry.

Owns the `Session` objects; applies the residency policy's decisions through
the mover; keeps the KV manager's tables consistent: a parked session's
device blocks live under `session.kv_key` (a `SessionBlocks`), a running
turn's under its request id. No torch and no clock: `now_s` comes in with
every call.

A session's state::

    open -> IDLE --begin_turn--> RUNNING --end_turn--> PARKED --begin_turn--> RUNNING --> ...
    any state --close, or idle past the TTL--> CLOSED (its KV freed in every tier)

Where a PARKED session's KV is (`Residency`), and what moves it::

    DEVICE           -> OFFLOADING   OFFLOAD action: the mover writes a copy; device blocks still held
    OFFLOADING       -> HOST | DISK  the copy landed: device blocks freed (their hashes kept)
    OFFLOADING       -> DEVICE       the copy failed, or a turn began first (the copy is discarded)
    HOST | DISK      -> RESTORING    PREFETCH action, or a turn began (the turn waits for it)
    RESTORING        -> DEVICE       the restore landed: a waiting turn takes the blocks
    RESTORING        -> NONE         the copy was corrupt or unreadable: recompute, never use it
    DEVICE|HOST|DISK -> NONE         DROP action (full blocks stay in the prefix cache until evicted)
    NONE                             the next turn recomputes what the prefix cache no longer holds

A turn that begins while its session's KV is off device waits (`Session.waiting_turn`, the sequence
`is_blocked`) until the restore lands; a restore that finds no free device blocks waits in
`_restore_queue` and is retried each tick. Closing a session whose restore is under way renames its
blocks to `SessionBlocks(id, closed=True)`, freed when the restore ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import fields

from sessionserve.cache.kv_manager import KVCacheManager
from sessionserve.core.parked_entries import ParkedEntries
from sessionserve.core.priority import priority_rank
from sessionserve.core.residency_view import (
    ActionKind,
    MoveCosts,
    ResidencyAction,
    ResidencyPolicy,
    ResidencyView,
)
from sessionserve.core.session import Residency, Session, SessionState, SessionStats, WaitingTurn
from sessionserve.core.wait_predictor import WaitPredictor
from sessionserve.types.kv_mover import KVMover, MoveDone, MoveKind, Tier
from sessionserve.types.sequence import Sequence, SequenceStatus, SessionBlocks


class SessionBusyError(ValueError):
    """The session cannot take this now (a turn is running, or its KV is moving); retry later."""


class SessionMovingError(SessionBusyError):
    """The session's KV is being copied between tiers: retry in a moment (the copy is short)."""


class SessionManager:
    """Session lifecycle and KV residency. Called from the engine thread only."""

    def __init__(self, kv: KVCacheManager, mover: KVMover | None, policy: ResidencyPolicy,
                 predictor: WaitPredictor | None = None, idle_ttl_s: float = 600.0,
                 costs: MoveCosts | None = None, max_sessions: int = 100_000) -> None:
        self.kv = kv
        self.mover = mover
        self.policy = policy
        self.predictor = predictor or WaitPredictor()
        self.idle_ttl_s = idle_ttl_s
        self.costs = costs or MoveCosts(host_s_per_block=1e-4, disk_s_per_block=1e-3, recompute_s_per_token=1e-3)
        self.max_sessions = max_sessions
        self.sessions: dict[str, Session] = {}
        # Restores waiting for device blocks, in request order (a dict, not a set: the retry order must not
        # depend on string hashing, so a run replays the same under any PYTHONHASHSEED).
        self._restore_queue: dict[str, None] = {}
        self._num_waiting_turns = 0  # sessions whose `waiting_turn` is set
        # Closed sessions whose device blocks a restore still writes: freed when it ends.
        self._closing: dict[str, SessionBlocks] = {}
        self._closed_stats = SessionStats()  # counters of closed sessions, for totals
        self.num_expired = 0
        self.num_corrupt_restores = 0
        self.num_failed_offloads = 0
        # What the last policy call saw (a change counter of the sessions, free/wanted blocks, costs) and
        # when its decision could next change by the clock alone: a tick with the same inputs before that
        # time skips the policy (same view, same answer) and the O(sessions) scans with it.
        self._version = 0
        self._decided: tuple | None = None
        self._decision_due_s: float | None = None
        self._due_view: ResidencyView | None = None  # the view whose next decision time is not asked yet
        # At most the last activity of the longest-idle session (exact after each expiry scan, lowered as
        # sessions go idle): sessions are scanned for expiry only once it is older than the TTL.
        self._oldest_idle_s: float | None = None
        self._entries = ParkedEntries(kv, self.predictor)  # the residency view's sessions
        # Called with the id of each session that closes (deleted, expired or evicted), after it is gone:
        # layers above that keep notes per session (the server's transcripts) forget them.
        self.on_close: list[Callable[[str], None]] = []
        # Sessions that do not expire however long they are idle: a turn of theirs waits to start (at the
        # admission door); their KV stays under the residency policy meanwhile.
        self.pinned: set[str] = set()
        # The sessions in the admission door's working set while the door holds turns (None: it does not, or
        # there is none): the residency view's `members`. The engine shares the door's own (a live view).
        self.members: AbstractSet[str] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def open(self, session_id: str, now_s: float, tenant: str = "", priority: str = "interactive") -> Session:
        if session_id in self.sessions:
            raise ValueError(f"session {session_id!r} already exists")
        priority_rank(priority)  # ValueError for an unknown class
        if len(self.sessions) >= self.max_sessions:
            raise ValueError(f"too many open sessions (limit {self.max_sessions})")
        session = Session(session_id, tenant=tenant, priority=priority, opened_s=now_s, last_active_s=now_s)
        self.sessions[session_id] = session
        self._touch(session_id)
        self._note_idle(now_s)
        return session

    def get(self, session_id: str) -> Session | None:
        return self.sessions.get(session_id)

    def __iter__(self) -> Iterator[Session]:
        return iter(self.sessions.values())

    def begin_turn(self, session: Session, seq: Sequence, num_new_tokens: int, now_s: float) -> None:
        """Attach a new turn `seq` (prompt = session tokens + new tokens) and bring the KV to it."""
        if session.state is SessionState.RUNNING:
            raise SessionBusyError(f"session {session.session_id!r} already has a turn running")
        if session.state is SessionState.CLOSED:
            raise ValueError(f"session {session.session_id!r} is closed")
        self._touch(session.session_id)
        stats = session.stats
        if session.state is SessionState.PARKED and session.parked_s is not None:
            wait_s = now_s - session.parked_s
            stats.total_wait_s += wait_s
            self.predictor.observe(session.waiting_tools, wait_s)
        session.state = SessionState.RUNNING
        session.request_id = seq.request_id
        session.last_active_s = now_s
        session.parked_s = None
        seq.kv_successor = session.kv_key
        seq.session_id = session.session_id
        stats.num_turns += 1
        stats.num_prompt_tokens += num_new_tokens
        res = session.residency
        if res is Residency.OFFLOADING:  # resumed before the offload finished: keep the device copy
            assert self.mover is not None
            self.mover.discard(session.session_id)
            session.residency = res = Residency.DEVICE
            session.stored_tier = None
        if res is Residency.DEVICE:
            if session.is_prefetched:
                stats.num_prefetch_hits += 1
            self._adopt(session, seq)
        elif res is Residency.RESTORING:
            stats.num_prefetch_late += 1
            self._block(session, seq, now_s)
        elif res in (Residency.HOST, Residency.DISK):
            stats.num_restore_misses += 1
            self._block(session, seq, now_s)
            self._start_restore(session)
        session.is_prefetched = False

    def end_turn(self, seq: Sequence, now_s: float) -> Session | None:
        """The turn finished (or was aborted): the session keeps what was computed and parks."""
        session = self.sessions.get(seq.session_id or "")
        if session is None or session.request_id != seq.request_id:
            return None
        self._touch(session.session_id)
        if self._take_waiting_turn(session) is not None:
            # Aborted while its KV was still coming back: the turn never ran, the session is as it was.
            session.request_id = None
            session.state = SessionState.PARKED
            session.parked_s = session.last_active_s = now_s
            self._note_idle(now_s)
            return session
        session.stats.num_computed_prompt_tokens += max(0, seq.num_prompt_tokens - (seq.num_cached_tokens or 0))
        dropped, session.num_dropped_tokens = session.num_dropped_tokens, 0
        session.stats.num_recompute_tokens += max(0, dropped - (seq.num_cached_tokens or 0))
        keep = seq.token_ids if seq.status is not SequenceStatus.FINISHED_ABORTED \
            else seq.token_ids[: max(seq.num_computed_tokens, seq.num_prompt_tokens)]
        session.token_ids = list(keep)
        session.num_computed_tokens = min(seq.num_computed_tokens, len(keep))
        session.request_id = None
        session.state = SessionState.PARKED
        session.parked_s = now_s
        session.last_active_s = now_s
        self._note_idle(now_s)
        session.waiting_tools, session.wait_hint_s = (), None
        hint = seq.park_hint
        if hint is not None and seq.status is not SequenceStatus.FINISHED_ABORTED:
            # Known with the turn: the policy's first look at the parked session sees what it waits on.
            session.wait_hint_s = hint.expected_wait_s
            if hint.tool_names is not None:
                session.waiting_tools = tuple(hint.tool_names(seq.output_token_ids))
        session.residency = Residency.DEVICE if self.kv.num_blocks_of(session.kv_key) else Residency.NONE
        if session.residency is Residency.NONE:
            self._note_drop(session)
        return session

    def truncate(self, session: Session, num_tokens: int) -> None:
        """Forget the session's history after `num_tokens` tokens (the client rewrote it)."""
        if session.state is SessionState.RUNNING:
            raise SessionBusyError(f"session {session.session_id!r} has a turn running")
        if num_tokens >= len(session.token_ids):
            return
        self._touch(session.session_id)
        # The KV first: if it cannot be cut now, the session is left exactly as it was.
        if session.residency is Residency.OFFLOADING:
            # Its device copy is still whole: keep it and cancel the copy out (as a resumed turn does), so
            # a client's rewrite never waits for an offload.
            assert self.mover is not None
            self.mover.discard(session.session_id)
            session.residency, session.stored_tier = Residency.DEVICE, None
        if session.num_computed_tokens > num_tokens:
            if session.residency is Residency.DEVICE:
                session.num_computed_tokens = self.kv.trim(session.kv_key, num_tokens)
            elif session.residency is not Residency.NONE:
                # Off device or moving: a partial copy back is not worth it; recompute (the
                # prefix cache may still hold the start).
                self._apply(ResidencyAction(ActionKind.DROP, session.session_id), session.last_active_s)
                if session.residency is not Residency.NONE:  # moving: wait for the move, then drop
                    raise SessionMovingError(f"session {session.session_id!r} is being moved; retry")
                session.num_dropped_tokens = 0
            else:
                session.num_dropped_tokens = min(session.num_dropped_tokens, num_tokens)
        session.token_ids = session.token_ids[:num_tokens]

    def set_wait(self, session_id: str, tools: tuple[str, ...] = (), wait_hint_s: float | None = None) -> None:
        """What a parked session waits on: the tools it called, and the client's expected wait."""
        session = self.sessions[session_id]
        session.waiting_tools = tuple(tools)
        session.wait_hint_s = wait_hint_s
        self._touch(session_id)

    def fork(self, parent: Session, child_id: str, now_s: float) -> Session:
        """A new session with `parent`'s history (same tenant and class); the parent is untouched.

        The child holds no KV of its own yet: its first turn finds the
        parent's full blocks in the prefix cache and shares them by reference
        count (blocks are immutable once full: copy-on-write for free); only
        the last partial block, and whatever the parent no longer has on the
        device, is computed again.
        """
        child = self.open(child_id, now_s, parent.tenant, parent.priority)
        child.token_ids = list(parent.token_ids)
        child.program.start_s = parent.program.start_s  # part of the parent's task: same place in line
        return child

    def close(self, session_id: str) -> bool:
        """Free the session's KV in every tier and forget it. The running turn, if any, is the caller's."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        self._touch(session_id)
        session.state = SessionState.CLOSED
        for f in fields(SessionStats):
            setattr(self._closed_stats, f.name, getattr(self._closed_stats, f.name) + getattr(session.stats, f.name))
        if session.residency is Residency.RESTORING:
            # The mover is still writing these device blocks: free them only when it is done.
            closing = SessionBlocks(session_id, closed=True)
            self.kv.rename(session.kv_key, closing)
            self._closing[session_id] = closing
        else:
            self.kv.free(session.kv_key)
        if self.mover is not None:
            self.mover.discard(session_id)
        self._take_waiting_turn(session)
        self._restore_queue.pop(session_id, None)
        session.num_dropped_tokens = 0
        session.residency = Residency.NONE
        for fn in self.on_close:
            fn(session_id)
        return True

    # -- the periodic part -------------------------------------------------------------------

    def tick(self, now_s: float, num_wanted_blocks: int) -> None:
        """Apply finished moves, expire idle sessions, and carry out the policy's actions."""
        if self.mover is not None:
            for done in self.mover.poll():
                self._touch(done.session_id)
                self._on_move_done(done, now_s)
        for sid in list(self._restore_queue):
            self._start_restore(self.sessions[sid])
        if self._oldest_idle_s is not None and now_s - self._oldest_idle_s > self.idle_ttl_s:
            self._expire(now_s)
        inputs = self._policy_inputs(num_wanted_blocks)
        if inputs == self._decided:
            due = self._decision_due()
            if due is None or now_s < due:
                return
        view = self.view(now_s, num_wanted_blocks)
        actions = self.policy.decide(view)
        self._decided = inputs
        # Actions change the sessions, so the next tick decides again anyway; without any, the policy's
        # next decision time is asked only if a tick comes with the same inputs (often they have moved).
        self._decision_due_s, self._due_view = None, (None if actions else view)
        for action in actions:
            self._apply(action, now_s)

    def _touch(self, session_id: str) -> None:
        """Note that a session changed: the policy looks again, at a rebuilt entry for it."""
        self._version += 1
        self._entries.touch(session_id)

    def _decision_due(self) -> float | None:
        if self._due_view is not None:
            self._decision_due_s, self._due_view = self.policy.next_decision_s(self._due_view), None
        return self._decision_due_s

    def next_wakeup_s(self, now_s: float, num_wanted_blocks: int = 0) -> float | None:
        """The earliest time a tick can act with no event in between (a move finishing, a turn arriving
        or ending): a residency decision coming due or a session expiring. `now_s` if the next tick must
        look anyway (inputs changed since the policy last ran, or restores wait for room); None if only
        an event can change anything."""
        if self._restore_queue \
                or self._decided != self._policy_inputs(num_wanted_blocks):
            return now_s
        expiry = None if self._oldest_idle_s is None else self._oldest_idle_s + self.idle_ttl_s
        due = [t for t in (self._decision_due(), expiry) if t is not None]
        return min(due) if due else None

    def _policy_inputs(self, num_wanted_blocks: int) -> tuple:
        mover = self.mover
        return (self._version, self.kv.num_free_blocks, num_wanted_blocks, self.costs,
                mover.num_free_blocks(Tier.HOST) if mover else 0, mover.num_free_blocks(Tier.DISK) if mover else 0)

    def _note_idle(self, now_s: float) -> None:
        if self._oldest_idle_s is None or now_s < self._oldest_idle_s:
            self._oldest_idle_s = now_s

    def _expire(self, now_s: float) -> None:
        """Close sessions idle past the TTL; note when the next one would expire."""
        idle = [s for s in self.sessions.values()
                if s.state is not SessionState.RUNNING and s.session_id not in self.pinned]
        for session in [s for s in idle if now_s - s.last_active_s > self.idle_ttl_s]:
            self.close(session.session_id)
            self.num_expired += 1
        left = [s.last_active_s for s in idle if s.session_id in self.sessions]
        self._oldest_idle_s = min(left) if left else None  # (the TTL may change: kept apart)

    def view(self, now_s: float, num_wanted_blocks: int) -> ResidencyView:
        self._entries.update(self.sessions, now_s)
        parked = self._entries.parked
        wanted = num_wanted_blocks + sum(self._num_blocks(self.sessions[sid]) for sid in self._restore_queue)
        mover = self.mover
        return ResidencyView(
            now_s=now_s, parked=parked, num_device_blocks=self.kv.pool.num_blocks,
            num_free_device_blocks=self.kv.num_free_blocks, num_wanted_device_blocks=wanted,
            num_free_host_blocks=mover.num_free_blocks(Tier.HOST) if mover else 0,
            num_free_disk_blocks=mover.num_free_blocks(Tier.DISK) if mover else 0, costs=self.costs,
            delta=self._entries.delta, members=self.members)

    @property
    def num_blocked(self) -> int:
        """Turns waiting for their session's KV to come back."""
        return self._num_waiting_turns

    @property
    def num_moves_pending(self) -> int:
        """Sessions with a move in flight (or blocks held for one): nonzero means not yet quiescent."""
        return len(self._closing) + sum(
            1 for s in self.sessions.values() if s.residency in (Residency.OFFLOADING, Residency.RESTORING))

    def total_stats(self) -> SessionStats:
        """Counters summed over every session, open or closed, since start."""
        total = SessionStats(**{f.name: getattr(self._closed_stats, f.name) for f in fields(SessionStats)})
        for session in self.sessions.values():
            for f in fields(SessionStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(session.stats, f.name))
        return total

    def residency_counts(self) -> dict[str, int]:
        """Parked sessions per residency (plus running), for metrics."""
        counts: dict[str, int] = {}
        for s in self.sessions.values():
            key = "running" if s.state is SessionState.RUNNING else s.residency.value
            counts[key] = counts.get(key, 0) + 1
        return counts

    def num_outside_blocks(self) -> int:
        """Device blocks that the parked KV of sessions outside the admission door's working set (`members`)
        would free: under pressure every residency policy takes theirs first. 0 while the door holds no one."""
        members = self.members
        if members is None:
            return 0
        return sum(self._num_blocks(s) - self._entries.num_shared_blocks(s) for s in self.sessions.values()
                   if s.state is SessionState.PARKED and s.residency is Residency.DEVICE
                   and s.session_id not in members)

    # -- internals ----------------------------------------------------------------------------

    def _num_blocks(self, session: Session) -> int:
        return self.kv.blocks_needed(session.num_computed_tokens)

    def _adopt(self, session: Session, seq: Sequence) -> None:
        """Give the session's device blocks to its running turn."""
        self.kv.rename(session.kv_key, seq.request_id)
        seq.num_computed_tokens = session.num_computed_tokens
        seq.is_blocked = False

    def _block(self, session: Session, seq: Sequence, now_s: float) -> None:
        seq.is_blocked = True
        session.waiting_turn = WaitingTurn(seq, now_s)
        self._num_waiting_turns += 1

    def _take_waiting_turn(self, session: Session) -> WaitingTurn | None:
        turn, session.waiting_turn = session.waiting_turn, None
        if turn is not None:
            self._num_waiting_turns -= 1
        return turn

    def _start_restore(self, session: Session) -> None:
        assert self.mover is not None
        n = self._num_blocks(session)
        if self.kv.allocate(session.kv_key, session.num_computed_tokens) is None:
            self._restore_queue[session.session_id] = None  # retried each tick; the policy sees the demand
            return
        self._restore_queue.pop(session.session_id, None)
        self._touch(session.session_id)
        session.residency = Residency.RESTORING
        self.mover.restore(session.session_id, self.kv.block_tables[session.kv_key][:n])

    def _note_drop(self, session: Session) -> None:
        session.num_dropped_tokens = session.num_computed_tokens
        session.num_computed_tokens = 0
        session.residency = Residency.NONE
        session.stored_tier = None

    def apply(self, action: ResidencyAction, now_s: float) -> None:
        """Carry out one residency action (the policy's, or an operator's). Ignored if not applicable."""
        self._apply(action, now_s)

    def _apply(self, action: ResidencyAction, now_s: float) -> None:
        session = self.sessions.get(action.session_id)
        if session is None or session.state is not SessionState.PARKED:
            return
        self._touch(session.session_id)
        if action.kind is ActionKind.DROP and session.residency in (Residency.DEVICE, Residency.HOST, Residency.DISK):
            self.kv.commit_full_blocks(session.kv_key, session.token_ids, session.num_computed_tokens)
            self.kv.free(session.kv_key)  # full blocks stay in the prefix cache until evicted
            if self.mover is not None:
                self.mover.discard(session.session_id)
            self._note_drop(session)
        elif action.kind is ActionKind.OFFLOAD and session.residency is Residency.DEVICE and self.mover is not None:
            n = self._num_blocks(session)
            blocks = self.kv.block_tables.get(session.kv_key, [])[:n]
            if blocks and self.mover.offload(session.session_id, blocks, action.tier or Tier.HOST):
                session.residency = Residency.OFFLOADING
                session.stored_tier = action.tier or Tier.HOST
        elif action.kind is ActionKind.PREFETCH and session.residency in (Residency.HOST, Residency.DISK):
            self._start_restore(session)
            if session.residency is Residency.RESTORING:
                session.is_prefetched = True

    def _on_move_done(self, done: MoveDone, now_s: float) -> None:
        closing = self._closing.pop(done.session_id, None)
        if closing is not None and done.kind is MoveKind.RESTORE:
            self.kv.free(closing)
        session = self.sessions.get(done.session_id)
        if session is None:
            return
        if done.kind is MoveKind.OFFLOAD:
            if session.residency is not Residency.OFFLOADING:
                return  # resumed meanwhile: the copy was discarded, device blocks kept
            if done.ok:
                self.kv.commit_full_blocks(session.kv_key, session.token_ids, session.num_computed_tokens)
                self.kv.free(session.kv_key, keep_hashes=True)  # committed again, unchanged, on restore
                session.residency = Residency.HOST if done.tier is Tier.HOST else Residency.DISK
                session.stats.num_offloaded_bytes += done.num_bytes
            else:
                self.num_failed_offloads += 1
                session.residency = Residency.DEVICE  # still held; the policy may drop it next
                session.stored_tier = None
            return
        # Restore.
        if session.residency is not Residency.RESTORING:
            return
        if done.ok:
            session.residency = Residency.DEVICE
            session.stored_tier = None
            session.stats.num_restored_bytes += done.num_bytes
            self.kv.commit_full_blocks(session.kv_key, session.token_ids, session.num_computed_tokens)
        else:
            # Corrupt or unreadable copy: recompute from the tokens, never use the bad data.
            self.num_corrupt_restores += 1
            self.kv.free(session.kv_key)
            self._note_drop(session)
        waiting = self._take_waiting_turn(session)
        if waiting is not None:
            seq, since_s = waiting
            session.stats.restore_blocked_s += now_s - since_s
            seq.restore_wait_s = now_s - since_s
            if session.residency is Residency.DEVICE:
                self._adopt(session, seq)
            seq.is_blocked = False
            session.is_prefetched = False
