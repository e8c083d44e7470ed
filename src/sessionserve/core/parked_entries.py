"""The residency view's parked sessions, kept up to date per session for the session manager.

An entry is rebuilt when its session changed (the manager says so), when its
prediction moved by more than PREDICTION_TOLERANCE, and all of them when some
block's sharing changed; an unchanged entry stays the same object, and each
new tuple comes with what changed since the one before (`ViewDelta`), so a
policy that keeps per-session state works in proportion to the changes.
No torch and no clock: `now_s` comes in with every call.
"""

from __future__ import annotations

from collections.abc import Mapping

from sessionserve.cache.kv_manager import KVCacheManager
from sessionserve.core.residency_view import ParkedSession, ViewDelta
from sessionserve.core.session import Residency, Session, SessionState
from sessionserve.core.wait_predictor import WaitPrediction, WaitPredictor

# A parked session's wait prediction is refreshed when the predictor's quantiles for it moved by more than
# this share (see ParkedEntries._refresh_predictions).
PREDICTION_TOLERANCE = 0.05


class ParkedEntries:
    """The parked sessions of a `SessionManager` as residency-view entries. Engine thread only."""

    def __init__(self, kv: KVCacheManager, predictor: WaitPredictor) -> None:
        self.kv = kv
        self.predictor = predictor
        self.parked: tuple[ParkedSession, ...] = ()  # in the order the sessions parked
        self.delta: ViewDelta | None = None  # how `parked` differs from the tuple before it
        self._entries: dict[str, ParkedSession] = {}
        # Sessions changed since the last update, in the order they first changed (a dict, not a set: the
        # order of `parked` must not depend on string hashing).
        self._changed: dict[str, None] = {}
        self._predictor_epoch = self._sharing_epoch = -1
        # Per prediction key (tools, hint): the prediction parked sessions with that key are judged on.
        self._prediction_refs: dict[tuple, WaitPrediction] = {}

    def touch(self, session_id: str) -> None:
        """The session changed: its entry is built again at the next update."""
        self._changed[session_id] = None

    def update(self, sessions: Mapping[str, Session], now_s: float) -> None:
        entries = self._entries
        if self.kv.pool.num_sharing_changes != self._sharing_epoch:  # any entry's shared blocks may differ
            self._sharing_epoch = self.kv.pool.num_sharing_changes
            self._changed.update(dict.fromkeys(entries))
        if self.predictor.num_observed != self._predictor_epoch:
            self._predictor_epoch = self.predictor.num_observed
            self._refresh_predictions(sessions)
        if not self._changed:
            return
        changed, gone = [], []
        for sid in self._changed:
            s = sessions.get(sid)
            if s is not None and s.state is SessionState.PARKED and s.residency is not Residency.NONE:
                entry = ParkedSession(
                    sid, s.residency, self.kv.blocks_needed(s.num_computed_tokens), s.num_computed_tokens,
                    s.parked_s if s.parked_s is not None else now_s, self._predict(s), self.num_shared_blocks(s))
                if entries.get(sid) != entry:  # an unchanged entry stays the same object
                    entries[sid] = entry
                    changed.append(entry)
            elif entries.pop(sid, None) is not None:
                gone.append(sid)
        self._changed.clear()
        if changed or gone:
            # In the order the sessions parked (ties in the policies' orders go to the earlier).
            self.delta = ViewDelta(self.parked, tuple(changed), tuple(gone))
            self.parked = tuple(entries.values())

    def _refresh_predictions(self, sessions: Mapping[str, Session]) -> None:
        """The predictor learned. Parked sessions are judged on the prediction for their key (tools, hint)
        as of the last refresh; it is renewed, and their entries rebuilt, once the predictor's median or
        90th percentile for the key (what the policies read) moved by more than PREDICTION_TOLERANCE.
        Each new wait nudges the quantiles a little; re-judging every parked session at each would cost
        O(parked) per turn for a change the policies' timings do not resolve."""
        refs, predict = self._prediction_refs, self.predictor.predict
        moved = set()
        for key, ref in refs.items():
            p = predict(*key)
            if abs(p.p50_s - ref.p50_s) > PREDICTION_TOLERANCE * ref.p50_s \
                    or abs(p.p90_s - ref.p90_s) > PREDICTION_TOLERANCE * ref.p90_s:
                moved.add(key)
        if moved:
            for key in moved:
                refs[key] = predict(*key)
            for sid in self._entries:
                s = sessions.get(sid)
                if s is not None and (s.waiting_tools, s.wait_hint_s) in moved:
                    self._changed[sid] = None
        if len(refs) > 2 * len(self._entries) + 64:  # keys no parked session has any more
            keys = {(s.waiting_tools, s.wait_hint_s) for s in map(sessions.get, self._entries) if s}
            self._prediction_refs = {k: v for k, v in refs.items() if k in keys}

    def _predict(self, session: Session) -> WaitPrediction:
        key = (session.waiting_tools, session.wait_hint_s)
        p = self._prediction_refs.get(key)
        if p is None:
            p = self._prediction_refs[key] = self.predictor.predict(*key)
        return p

    def num_shared_blocks(self, session: Session) -> int:
        """Device blocks of the session that other sequences hold too. Sharing comes from prefix hits and
        forks, so it is a prefix of the table: the leading run is counted, at the time of the view."""
        table = self.kv.block_tables.get(session.kv_key) if session.residency is Residency.DEVICE else None
        refs = self.kv.pool.ref_counts
        n = 0
        for block in table or ():
            if refs[block] < 2:
                break
            n += 1
        return n
