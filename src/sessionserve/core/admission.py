"""Session admission by working set: new sessions wait at the door while the admitted ones' contexts fill the KV.

An agent session comes back every few seconds for tens of turns. Past the
load where KV memory holds the contexts of the sessions in flight, every new
session admitted makes returning turns find their KV evicted by others: they
recompute it and evict someone else's, and completed turns per second fall as
the load rises (thrashing). So a session's first turn is admitted only while
the working set, the context blocks of the admitted sessions that are still
active, leaves room for it; otherwise it waits at the door, in the
scheduler's order (priority classes, program order), and the admitted
sessions run at full speed. A session stops counting once it has been idle
well past its expected tool wait (an agent that finished sends no more turns
and rarely says so); its next turn, if one comes, is a new arrival.

Pure: a frozen policy over a view; no clock (`now_s` comes in), no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from sessionserve.core.sequence import Sequence
    from sessionserve.core.session import Session
    from sessionserve.core.session_manager import SessionManager


class Member(NamedTuple):
    """A session the policy admitted earlier (or a running request without a session)."""

    key: str
    num_blocks: int  # context blocks it holds or will need back
    idle_s: float | None  # time parked; None while a turn runs
    expected_wait_s: float | None  # its predicted tool wait (p90), when known


class Candidate(NamedTuple):
    """A turn waiting at the door: a new session's first, or one whose session no longer counts."""

    request_id: str
    key: str
    num_blocks: int  # the context it brings into the working set


class AdmissionView(NamedTuple):
    members: tuple[Member, ...]
    candidates: tuple[Candidate, ...]  # in the scheduler's order
    num_running: int  # sequences running now (admitted or not: requests already in flight)


@dataclass(frozen=True)
class WorkingSetAdmission:
    """Admit candidates, in order, while the active members' blocks plus theirs fit `budget_blocks`.

    A parked member is active for `hold_factor` times its expected wait, and at least `min_hold_s`
    (agents with no hint still come back within seconds). The first candidate is admitted whatever its
    size when nothing is active or running (a single session larger than the budget still runs).
    """

    budget_blocks: int
    min_hold_s: float = 5.0
    hold_factor: float = 3.0

    def is_active(self, m: Member) -> bool:
        if m.idle_s is None:
            return True
        return m.idle_s <= max(self.min_hold_s, self.hold_factor * (m.expected_wait_s or 0.0))

    def working_set_blocks(self, members: tuple[Member, ...]) -> int:
        return sum(m.num_blocks for m in members if self.is_active(m))

    def admit(self, view: AdmissionView) -> tuple[str, ...]:
        """Request ids to admit now, a prefix of `view.candidates` (none overtakes one that waits)."""
        used = self.working_set_blocks(view.members)
        idle = used == 0 and view.num_running == 0
        admitted: list[str] = []
        for c in view.candidates:
            if used + c.num_blocks > self.budget_blocks and not (idle and not admitted):
                break
            admitted.append(c.request_id)
            used += c.num_blocks
        return tuple(admitted)


class AdmissionDoor:
    """The engine's side of admission: which turns wait at the door, and which sessions are admitted.

    `must_wait` / `hold` decide, when a turn is added, whether it waits (it is marked `is_held`; the
    scheduler skips held turns); `release` asks the policy each step and lets in what it admits. Called
    from the engine thread only.
    """

    def __init__(self, policy: WorkingSetAdmission, block_size: int) -> None:
        self.policy = policy
        self.block_size = block_size
        self.held: list[Sequence] = []
        self.admitted: dict[str, None] = {}  # admitted session ids, in admission order
        self.num_held_total = 0  # turns that waited at the door, since start

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def member(self, session: Session, now_s: float, sessions: SessionManager) -> Member:
        idle = None if session.parked_s is None else max(0.0, now_s - session.parked_s)
        expected = sessions.predictor.predict(session.waiting_tools, session.wait_hint_s).p90_s \
            if idle is not None else None
        return Member(session.session_id, self._blocks(len(session.token_ids)), idle, expected)

    def must_wait(self, session: Session | None, now_s: float, sessions: SessionManager | None) -> bool:
        """Whether a turn of `session` (None: a request without one) waits at the door: unless its session is
        admitted and still active. Asked before the session starts the turn; changes nothing."""
        return not (session is not None and session.session_id in self.admitted and sessions is not None
                    and self.policy.is_active(self.member(session, now_s, sessions)))

    def hold(self, seq: Sequence) -> None:
        """`seq` (queued in the scheduler) waits at the door; its session is admitted again when let in."""
        if seq.session_id is not None:
            self.admitted.pop(seq.session_id, None)
        seq.is_held = True
        self.held.append(seq)
        self.num_held_total += 1

    def release(self, now_s: float, running: list[Sequence], sessions: SessionManager | None,
                order: Callable[[Sequence], object]) -> None:
        """Let in the held turns the policy admits now (in the scheduler's `order`)."""
        self.held = [s for s in self.held if s.is_held and not s.is_finished]
        if not self.held:
            return
        members: list[Member] = []
        for sid in list(self.admitted):
            session = sessions.get(sid) if sessions is not None else None
            if session is None:
                del self.admitted[sid]  # closed or expired
            else:
                members.append(self.member(session, now_s, sessions))
        members += [Member(s.request_id, self._blocks(s.num_tokens), None, None)
                    for s in running if s.session_id is None]
        self.held.sort(key=order)
        candidates = tuple(Candidate(s.request_id, s.session_id or s.request_id, self._blocks(s.num_tokens))
                           for s in self.held)
        let_in = set(self.policy.admit(AdmissionView(tuple(members), candidates, len(running))))
        for seq in self.held:
            if seq.request_id in let_in:
                seq.is_held = False
                if seq.session_id is not None:
                    self.admitted[seq.session_id] = None
        self.held = [s for s in self.held if s.is_held]
