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

The admitted sessions' tool waits often overlap: then nothing runs while turns
wait at the door. Such an idle engine lends its time: the first waiting turn
whose context fits the KV blocks nobody holds, or only sessions without a
place hold (its own among them), runs on loan (`lend`). It takes
no place in the working set (its session's next turn waits at the door again,
in its place in line), and its session's KV is the first to leave when memory
is short (the residency view's `members`), so the admitted sessions keep their
memory, and the cores that would idle do work.

The door pays only where thrashing costs more than waiting: with "auto" admission (the default) it holds
turns only while recomputing a session's context takes more engine time than an agent's tool wait, as
measured on this machine (`door_pays`); otherwise every turn goes in, as with admission off. When the door
starts to hold, the sessions that went in while it did not keep their places in the order they came, as far
as the budget goes; the rest wait at the door with their next turns (`AdmissionDoor.enforce`): a burst of
sessions that arrived before anything was measured would otherwise thrash until the last of them ends.

Pure: a frozen policy over a view; no clock (`now_s` comes in), no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from sessionserve.core.session import Session
    from sessionserve.core.session_manager import SessionManager
    from sessionserve.types.sequence import Sequence


class AdmissionFull(Exception):
    """A new session's turn refused at the door (`admission_when_full="reject"`): retry after `retry_after_s`."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"the server is at its working set of agent sessions; retry in {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s


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
    # The context a session reaches before it leaves the working set, as measured on the sessions that
    # left it (0: none yet). A session admitted small grows to about that: it is reserved from the start.
    typical_blocks: int = 0
    # Where the engine has nothing to run, the KV blocks a loan may take: those nobody holds (free or only
    # cached) and those the residency policy frees first, the parked KV of sessions without a place (the
    # waiting turns' own among them); 0 otherwise.
    loanable_blocks: int = 0


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

    def working_set_blocks(self, members: tuple[Member, ...], typical_blocks: int = 0) -> int:
        """Blocks the active members hold or will grow to (each at least `typical_blocks`)."""
        return sum(max(m.num_blocks, typical_blocks) for m in members if self.is_active(m))

    def admit(self, view: AdmissionView) -> tuple[str, ...]:
        """Request ids to admit now, a prefix of `view.candidates` (none overtakes one that waits)."""
        used = self.working_set_blocks(view.members, view.typical_blocks)
        idle = used == 0 and view.num_running == 0
        admitted: list[str] = []
        for c in view.candidates:
            need = max(c.num_blocks, view.typical_blocks)
            if used + need > self.budget_blocks and not (idle and not admitted):
                break
            admitted.append(c.request_id)
            used += need
        return tuple(admitted)

    def lend(self, view: AdmissionView) -> str | None:
        """The candidate to run one turn on loan while the engine idles (`view.loanable_blocks`): the first,
        in order, whose context fits them (its own size now, not what it may grow to: the loan is for this
        turn), if nothing runs. A loan takes no place, so one behind a larger turn may have it: the larger
        keeps its place for admission. Ask only when `admit` lets no one in."""
        if view.num_running or not view.loanable_blocks:
            return None
        return next((c.request_id for c in view.candidates if c.num_blocks <= view.loanable_blocks), None)


def door_pays(recompute_s_per_token: float | None, context_tokens: float, wait_s: float | None) -> bool:
    """Whether holding new sessions at the door pays on this machine and model ("auto" admission).

    Past the knee, a newcomer admitted beyond the budget costs, each time it evicts an admitted session's
    context, that context's recompute: `context_tokens` at the measured `recompute_s_per_token` of engine
    time. Holding it costs engine time only when every admitted session waits on its tools at once: up to
    a tool wait, `wait_s` (the agents' typical). So the door holds only where recomputing a context costs
    more than a tool wait: a large model with long contexts and short waits (thrashing is ruinous there),
    not a tiny model whose contexts are cheap to recompute (holding would only idle the engine). Until both
    are measured (no prefill timed, no wait seen yet) it does not hold: a server whose sessions never come
    back (chat clients, implicit sessions) must not fill its working set with them and make others wait.
    """
    if recompute_s_per_token is None or wait_s is None:
        return False
    return recompute_s_per_token * context_tokens > wait_s


class AdmissionDoor:
    """The engine's side of admission: the turns that wait at the door, and the sessions admitted.

    A turn that must wait (`must_wait`) is kept here, not in the scheduler: its session has not started
    it, so the session stays parked and its KV stays under the residency policy (a held turn holds no
    device blocks). Each step `release` asks the policy and hands back, in the scheduler's order, the
    turns it lets in; the engine then starts them. Called from the engine thread only.
    """

    def __init__(self, policy: WorkingSetAdmission, block_size: int, auto: bool = False) -> None:
        self.policy = policy
        self.block_size = block_size
        # "auto": the door holds turns only while `door_pays` (the engine sets `enforcing` from its measured
        # costs); while it does not, every turn goes in and the door only keeps count of the sessions.
        self.auto = auto
        self.enforcing = not auto
        self.held: list[HeldTurn] = []
        self.admitted: dict[str, int] = {}  # admitted session id -> the most blocks its context reached
        self.num_held_total = 0  # turns that waited at the door, since start
        self.num_demoted = 0  # sessions that went in while the door was open and lost their place when it closed
        self.num_rejected = 0  # new sessions' turns refused at the door (admission_when_full="reject")
        self.num_lent = 0  # turns let in on loan while the engine had nothing to run (`WorkingSetAdmission.lend`)
        # EMA of the context sessions reached when they left the working set (0: none left yet).
        self.typical_blocks = 0.0

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def member(self, session: Session, now_s: float, sessions: SessionManager) -> Member:
        idle = None if session.parked_s is None else max(0.0, now_s - session.parked_s)
        expected = sessions.predictor.predict(session.waiting_tools, session.wait_hint_s).p90_s \
            if idle is not None else None
        return Member(session.session_id, self._blocks(len(session.token_ids)), idle, expected)

    def must_wait(self, session: Session | None, now_s: float, sessions: SessionManager | None) -> bool:
        """Whether a turn of `session` (None: a request without one) waits at the door: unless its session is
        admitted and still active. Changes nothing."""
        if not self.enforcing or (session is None and self.auto):  # "auto" holds sessions only
            return False
        return not (session is not None and session.session_id in self.admitted and sessions is not None
                    and self.policy.is_active(self.member(session, now_s, sessions)))

    def entered(self, session_id: str, num_context_tokens: int, now_s: float, running: list[Sequence],
                sessions: SessionManager) -> None:
        """A turn of a session (`num_context_tokens` with its history) went in while the door does not enforce
        its budget: count the session as admitted, so its next turns pass once the door does, and forget the
        sessions that left."""
        if session_id not in self.admitted:
            self._members(now_s, running, sessions)
        self.admitted[session_id] = max(self.admitted.get(session_id, 0), self._blocks(num_context_tokens))

    def enforce(self, now_s: float, running: list[Sequence], sessions: SessionManager) -> None:
        """The door starts to hold ("auto"): the admitted sessions keep their places in the order they went in,
        up to the first whose context no longer fits the budget; the others stop counting as admitted, so each
        waits at the door with its next turn (a turn running now finishes) and goes in, in the scheduler's order, when
        there is room. Without this, sessions let in while the door was open would thrash until they end."""
        self.enforcing = True
        # The policy's own rule, as if every admitted session arrived anew in the order it went in.
        in_order = tuple(Candidate(m.key, m.key, m.num_blocks) for m in self._members(now_s, running, sessions)
                         if m.key in self.admitted)
        keep = set(self.policy.admit(AdmissionView((), in_order, 0, round(self.typical_blocks))))
        for sid in [sid for sid in self.admitted if sid not in keep]:
            del self.admitted[sid]
            self.num_demoted += 1

    def context_tokens(self, arriving_tokens: int) -> float:
        """The context an admitted session holds now, on average (what thrashing makes one recompute); with
        none admitted, the context sessions typically reached when they left, else the arriving turn's."""
        if self.admitted:
            return self.block_size * sum(self.admitted.values()) / len(self.admitted)
        return self.block_size * self.typical_blocks or arriving_tokens

    def is_holding(self, session_id: str) -> bool:
        return self.held_turn(session_id) is not None

    def held_turn(self, session_id: str) -> HeldTurn | None:
        """The turn of `session_id` waiting at the door, if one does."""
        return next((h for h in self.held if h.session_id == session_id), None)

    def hold(self, seq: Sequence, session_id: str | None, num_new_tokens: int) -> None:
        """`seq` waits at the door (`num_new_tokens`: what it adds to its session when it starts)."""
        if session_id is not None and session_id in self.admitted:
            self._left(self.admitted.pop(session_id))
        seq.is_held = True
        self.held.append(HeldTurn(seq, session_id, num_new_tokens))
        self.num_held_total += 1

    def drop(self, seq: Sequence) -> HeldTurn | None:
        """Forget a held turn (aborted); None if it is not held here."""
        found = next((h for h in self.held if h.seq is seq), None)
        if found is not None:
            self.held = [h for h in self.held if h.seq is not seq]
        return found

    def _members(self, now_s: float, running: list[Sequence], sessions: SessionManager | None) -> list[Member]:
        """The active admitted sessions (those that left are forgotten here) and the running requests without
        a session."""
        members: list[Member] = []
        # A session's history grows when its turn ends: while one runs, its sequence holds the context.
        in_turn = {s.session_id: s.num_tokens for s in running if s.session_id is not None}
        for sid, peak in list(self.admitted.items()):
            session = sessions.get(sid) if sessions is not None else None
            if session is None:  # closed or expired
                self._left(self.admitted.pop(sid))
                continue
            m = self.member(session, now_s, sessions)
            if sid in in_turn:
                m = m._replace(num_blocks=max(m.num_blocks, self._blocks(in_turn[sid])))
            if not self.policy.is_active(m):  # idle past its wait: it left (its next turn is a new arrival)
                self._left(self.admitted.pop(sid))
                continue
            self.admitted[sid] = max(peak, m.num_blocks)
            members.append(m)
        # Running turns outside the admitted sessions hold blocks too: requests without a session, and the
        # turns in flight of sessions that lost their place (`enforce`).
        return members + [Member(s.session_id or s.request_id, self._blocks(s.num_tokens), None, None)
                          for s in running if s.session_id is None or s.session_id not in self.admitted]

    def retry_after_s(self, seq: Sequence, session_id: str | None, num_new_tokens: int, now_s: float,
                      running: list[Sequence], sessions: SessionManager | None) -> float | None:
        """None when a turn that must wait would be let in at once (nobody waits before it and its context
        fits beside the active sessions); else when to try again: until the first active parked session
        is expected to stop counting (at least 1 s; 30 s when none is parked)."""
        members = self._members(now_s, running, sessions)
        turn = HeldTurn(seq, session_id, num_new_tokens)
        view = AdmissionView(tuple(members), (Candidate(seq.request_id, session_id or seq.request_id,
                                                        self._blocks(turn.num_context_tokens(sessions))),),
                             len(running), round(self.typical_blocks))
        if not self.held and self.policy.admit(view):
            return None
        left = [max(self.policy.min_hold_s, self.policy.hold_factor * (m.expected_wait_s or 0.0)) - m.idle_s
                for m in members if m.idle_s is not None]
        return max(1.0, min(left)) if left else 30.0

    def release(self, now_s: float, running: list[Sequence], sessions: SessionManager | None,
                order: Callable[[Sequence], object], loanable_blocks: int = 0) -> list[HeldTurn]:
        """The held turns the policy lets in now, in the scheduler's `order`; the engine starts them.
        `loanable_blocks`: the KV blocks a loan may take, when the engine has nothing to run (0: it has; see
        `AdmissionView`); then, if the policy admits no one, one turn may go in on loan
        (`WorkingSetAdmission.lend`)."""
        if not self.held:
            return []
        members = self._members(now_s, running, sessions)
        self.held.sort(key=lambda h: order(h.seq))
        candidates = tuple(Candidate(h.seq.request_id, h.session_id or h.seq.request_id,
                                     self._blocks(h.num_context_tokens(sessions))) for h in self.held)
        lent: str | None = None
        if self.enforcing:
            view = AdmissionView(tuple(members), candidates, len(running), round(self.typical_blocks),
                                 loanable_blocks)
            let_in = set(self.policy.admit(view))
            if not let_in and (lent := self.policy.lend(view)) is not None:
                let_in = {lent}
                self.num_lent += 1
        else:
            let_in = {c.request_id for c in candidates}
        out = [h for h in self.held if h.seq.request_id in let_in]
        self.held = [h for h in self.held if h.seq.request_id not in let_in]
        for h in out:
            h.seq.is_held = False
            if h.session_id is not None and h.seq.request_id != lent:
                self.admitted[h.session_id] = self._blocks(h.num_context_tokens(sessions))
        return out

    def _left(self, peak_blocks: int) -> None:
        """A session left the working set at `peak_blocks`: what the next ones will likely grow to."""
        self.typical_blocks = peak_blocks if not self.typical_blocks else \
            0.9 * self.typical_blocks + 0.1 * peak_blocks


class HeldTurn(NamedTuple):
    seq: Sequence
    session_id: str | None
    num_new_tokens: int  # the turn's own tokens (its session's come first)

    def num_context_tokens(self, sessions: SessionManager | None) -> int:
        session = sessions.get(self.session_id) if sessions is not None and self.session_id else None
        return (len(session.token_ids) if session is not None else 0) + self.num_new_tokens
