"""The engine loop: schedule -> execute -> apply. Token level; text lives outside core.

The engine does not know which clock it runs on: `clock` is any zero-argument
function returning seconds (wall time in serving, virtual time in simulation).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from sessionserve.cache.kv_manager import KVCacheManager
from sessionserve.config import SchedulerConfig
from sessionserve.core.admission import AdmissionDoor, AdmissionFull, WorkingSetAdmission, door_pays
from sessionserve.core.priority import priority_rank
from sessionserve.core.scheduler import Scheduler
from sessionserve.core.session import Session, SessionState
from sessionserve.core.session_manager import SessionBusyError, SessionManager
from sessionserve.core.spec import Proposer, SpecPolicy, StepCostFit
from sessionserve.types.executor import Executor, ExecutorOutput
from sessionserve.types.sampling_params import SamplingParams
from sessionserve.types.scheduler_output import ScheduledChunk, SchedulerOutput
from sessionserve.types.sequence import ParkHint, Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepOutput:
    """What one step did to one sequence."""

    seq: Sequence
    new_token_ids: list[int]
    finished: bool


class EngineCore:
    """Holds the scheduler, the KV manager and an executor; runs one step at a time."""

    def __init__(self, scheduler_config: SchedulerConfig, kv: KVCacheManager, executor: Executor,
                 clock: Callable[[], float], eos_token_ids: tuple[int, ...], max_model_len: int,
                 sessions: SessionManager | None = None, proposer: Proposer | None = None,
                 spec_policy: SpecPolicy | None = None) -> None:
        self.kv = kv
        self.scheduler = Scheduler(scheduler_config, kv)
        self.executor = executor
        self.clock = clock
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.requests: dict[str, Sequence] = {}
        self.num_steps = 0
        self.sessions = sessions
        # Measured seconds per prefilled token (EMA over prefill-heavy steps): the recompute cost.
        self.prefill_s_per_token: float | None = None
        # Speculative decoding (core/spec.py): who proposes, how many, and what came of it.
        self.proposer = proposer
        self.spec_policy = spec_policy or SpecPolicy()
        self.num_spec_proposed = 0
        self.num_spec_accepted = 0
        self.num_spec_steps = 0  # sequence-steps that verified at least one proposed token
        self.execute_s: float | None = None  # EMA of a decode step's executor time (the draft cost's unit)
        self.num_failed_steps = 0  # steps whose executor raised (each request then ran alone; see _execute)
        self.num_aborted = 0
        self.num_aborted_before_start = 0  # aborted while queued (or held at the door): nothing computed
        self.num_aborted_prefill_tokens = 0  # prompt tokens computed (not cached) for requests then aborted
        self.step_fit = StepCostFit()  # decode step time vs tokens: where verifying drafts stops being free
        # Session admission by working set (None: off): new sessions wait at the door past the knee ("auto":
        # only while that pays, see _update_door).
        self.door = AdmissionDoor(WorkingSetAdmission(int(kv.pool.num_blocks * scheduler_config.admission_fill),
                                                      scheduler_config.admission_hold_s), kv.block_size,
                                  auto=scheduler_config.admission == "auto") \
            if scheduler_config.admission != "off" else None
        self._share_members()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    salt: bytes = b"", session_id: str | None = None, priority: str | None = None,
                    park_hint: ParkHint | None = None) -> Sequence:
        """Queue a request, or the next turn of a session (`prompt_token_ids` = the new tokens only).

        `priority` ("interactive" | "batch"): default the session's, else interactive. `park_hint`: what
        the session waits on once this turn ends (read when it ends, before the residency policy looks).
        Raises ValueError for a duplicate id, an empty or too-long prompt, an
        unknown or busy session, an unknown priority.
        """
        session = self._session(session_id) if session_id is not None else None
        rank = priority_rank(priority or (session.priority if session is not None else "interactive"))
        if session is not None:
            new_ids = list(prompt_token_ids)
            prompt_token_ids = session.token_ids + new_ids
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; this model's context is "
                             f"{self.max_model_len} tokens, including the output")
        seq = Sequence(request_id=request_id, token_ids=list(prompt_token_ids),
                       num_prompt_tokens=len(prompt_token_ids), sampling_params=params,
                       arrival_s=self.clock(), eos_token_ids=self.eos_token_ids,
                       max_model_len=self.max_model_len, salt=salt, priority=rank, park_hint=park_hint)
        if session is not None:
            seq.program = session.program
            seq.service_at_arrival = session.program.service_tokens
        if seq.program.start_s is None:
            seq.program.start_s = seq.arrival_s
        self.scheduler.check_fits(seq)
        sid = session.session_id if session is not None else None
        num_new = len(new_ids) if session is not None else seq.num_tokens  # what the turn adds to its context
        self._update_door(seq.num_tokens, seq.arrival_s)
        if self.door is not None and self.door.must_wait(session, seq.arrival_s, self.sessions):
            # At the door: the session does not start the turn yet (its KV stays parked).
            if session is not None and (session.state is SessionState.RUNNING or self.door.is_holding(sid)):
                raise SessionBusyError(f"session {sid!r} already has a turn running")
            if self.scheduler.config.admission_when_full == "reject":
                wait = self.door.retry_after_s(seq, sid, num_new, seq.arrival_s, self.scheduler.running,
                                               self.sessions)
                if wait is not None:
                    self.door.num_rejected += 1
                    raise AdmissionFull(wait)
            self.door.hold(seq, sid, num_new)
            if session is not None:
                assert self.sessions is not None
                self.sessions.pinned.add(sid)
        else:
            if self.door is not None and session is not None and not self.door.enforcing:
                assert self.sessions is not None
                self.door.entered(session.session_id, seq.num_tokens, seq.arrival_s, self.scheduler.running,
                                  self.sessions)
            self._start(seq, session, num_new if session is not None else 0, seq.arrival_s)
        self.requests[request_id] = seq
        return seq

    def _start(self, seq: Sequence, session: Session | None, num_new_tokens: int, now_s: float) -> None:
        """The turn begins: its session (if any) brings its KV to it, and it queues in the scheduler."""
        if session is not None:
            assert self.sessions is not None
            self.sessions.pinned.discard(session.session_id)
            self.sessions.begin_turn(session, seq, num_new_tokens, now_s)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks (a session keeps what was computed). False if unknown/finished."""
        seq = self.requests.get(request_id)
        if seq is None or seq.is_finished:
            self.requests.pop(request_id, None)
            return False
        self.num_aborted += 1
        if seq.first_scheduled_s is None:
            self.num_aborted_before_start += 1
        self.num_aborted_prefill_tokens += max(0, min(seq.num_computed_tokens, seq.num_prompt_tokens)
                                                  - (seq.num_cached_tokens or 0))
        self.finish(request_id, SequenceStatus.FINISHED_ABORTED)
        return True

    def finish(self, request_id: str, status: SequenceStatus = SequenceStatus.FINISHED_STOPPED) -> None:
        """End a request early (e.g. a stop string matched in its text, or an abort)."""
        seq = self.requests.pop(request_id, None)
        held = self.door.drop(seq) if seq is not None and seq.is_held and self.door is not None else None
        if held is not None:
            seq.status, seq.finished_s = status, self.clock()  # never started: nothing to free
            if self.sessions is not None and held.session_id is not None:
                self.sessions.pinned.discard(held.session_id)
            return
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, status)
            seq.finished_s = self.clock()
            if self.sessions is not None and seq.session_id is not None:
                self.sessions.end_turn(seq, seq.finished_s)

    def _propose(self) -> None:
        """Ask the proposer for tokens for every running decode that may draft, k per the policy."""
        seqs: list[Sequence] = []
        counts: list[int] = []
        batch = len(self.scheduler.running)
        forward_s = self.proposer.forward_s if self.proposer is not None else None
        draft_cost = forward_s / self.execute_s if forward_s is not None and self.execute_s else None
        # Until decode steps of a few sizes were timed, verification is taken as nearly free (it is at
        # small batches); the drafts themselves vary the step sizes, and the fit then decides.
        saturation = self.step_fit.saturation_tokens() or float("inf")
        for seq in self.scheduler.running:
            seq.spec_token_ids.clear()
            seq.spec_probs = None
            params = seq.sampling_params
            if seq.num_uncomputed_tokens != 1 or not params.can_speculate \
                    or seq.num_output_tokens < params.min_tokens:
                continue
            remaining = min(params.max_tokens - seq.num_output_tokens, seq.max_model_len - seq.num_tokens)
            k = self.spec_policy.num_draft_tokens(seq.spec_acceptance, remaining, batch, draft_cost, saturation)
            if k > 0:
                seqs.append(seq)
                counts.append(k)
            else:
                seq.spec_acceptance = self.spec_policy.update(seq.spec_acceptance, 0, 0)
        if seqs:
            assert self.proposer is not None
            self.proposer.propose(seqs, counts)

    def _execute(self, plan: SchedulerOutput) -> tuple[ExecutorOutput, dict[str, str]]:
        """Run the plan. If it raises, run its chunks one at a time: a request whose inputs make the step
        fail fails alone (returned: request id -> why); the others get the tokens the whole step would give."""
        try:
            return self.executor.execute(plan), {}
        except Exception:
            self.num_failed_steps += 1
            logger.exception("engine step failed (%d requests); running them one at a time", len(plan.chunks))
        sampled: dict[str, int] = {}
        logprobs: dict[str, dict[int, float]] = {}
        accepted: dict[str, list[int]] = {}
        failed: dict[str, str] = {}
        for i, chunk in enumerate(plan.chunks):
            alone = replace(plan, chunks=(chunk,), num_batched_tokens=chunk.num_tokens,
                            preempted=plan.preempted if i == 0 else ())
            try:
                out = self.executor.execute(alone)
            except Exception as exc:  # noqa: BLE001 - this request's failure, reported on its own stream
                failed[chunk.seq.request_id] = f"{type(exc).__name__}: {exc}"
                continue
            sampled.update(out.sampled)
            logprobs.update(out.logprobs)
            accepted.update(out.accepted)
        return ExecutorOutput(sampled, logprobs, accepted), failed

    # -- sessions ---------------------------------------------------------------------------

    def open_session(self, session_id: str, tenant: str = "", priority: str = "interactive") -> Session:
        if self.sessions is None:
            raise ValueError("sessions are not enabled on this engine")
        return self.sessions.open(session_id, self.clock(), tenant, priority)

    def close_session(self, session_id: str) -> bool:
        """Close a session: abort its running turn, free its KV everywhere."""
        session = self._session(session_id)
        if session.request_id is not None:
            self.abort(session.request_id)
        held = self.door.held_turn(session_id) if self.door is not None else None
        if held is not None:  # a turn waiting at the door: it never starts
            self.abort(held.seq.request_id)
        assert self.sessions is not None
        return self.sessions.close(session_id)

    def _session(self, session_id: str | None) -> Session:
        session = self.sessions.get(session_id or "") if self.sessions is not None else None
        if session is None:
            raise ValueError(f"unknown session {session_id!r}")
        return session

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or (self.door is not None and bool(self.door.held))

    def step(self) -> list[StepOutput]:
        """Run one step. Returns the sequences that got a token or finished."""
        if self.proposer is not None:
            self._propose()
        if self.door is not None and self.door.held:
            now = self.clock()
            self._update_door(self.door.held[0].seq.num_tokens, now)
            self._let_in(now)
        plan: SchedulerOutput = self.scheduler.schedule(self.clock(), self._prefill_tokens())
        if plan.is_empty:
            if self.sessions is not None:
                if self.sessions.num_blocked and self.sessions.mover is not None:
                    self.sessions.mover.wait(0.005)  # only restores are pending: wait for one
                self.sessions.tick(self.clock(), self.scheduler.num_wanted_blocks)
            return []
        t0 = self.clock()
        for chunk in plan.chunks:
            if chunk.seq.first_scheduled_s is None:
                chunk.seq.first_scheduled_s = t0
        num_before = {chunk.seq: chunk.seq.num_tokens for chunk in plan.chunks if chunk.num_spec}
        result, failed = self._execute(plan)
        if failed:
            plan = replace(plan, chunks=tuple(c for c in plan.chunks if c.seq.request_id not in failed),
                           num_batched_tokens=sum(c.num_tokens for c in plan.chunks
                                                  if c.seq.request_id not in failed))
        finished = self.scheduler.update(plan, result.sampled, result.accepted)
        now = self.clock()
        self._observe_step_time(plan, now - t0)
        self.num_steps += 1
        outputs = [out for chunk in plan.chunks
                   if (out := self._output(chunk, result, num_before, now)) is not None]
        for request_id, error in failed.items():
            seq = self.requests.get(request_id)
            if seq is not None:
                seq.error = error
                self.finish(request_id, SequenceStatus.FINISHED_ABORTED)
                outputs.append(StepOutput(seq, [], True))
        for seq in finished:
            seq.finished_s = now
            self.requests.pop(seq.request_id, None)
            if self.sessions is not None and seq.session_id is not None:
                self.sessions.end_turn(seq, now)
        if self.sessions is not None:
            # After parking this step's finished turns, so the policy sees them at once.
            self.sessions.tick(now, self.scheduler.num_wanted_blocks)
        return outputs

    def _let_in(self, now: float) -> None:
        """Start the turns the admission door lets in now."""
        assert self.door is not None
        # Room for a loan while nothing runs: the free blocks and those the parked outsiders' KV would free
        # (the waiting turn's own session's among them): the residency policy takes theirs first.
        loanable = 0 if self.scheduler.num_unfinished else \
            self.kv.num_free_blocks + (self.sessions.num_outside_blocks() if self.sessions is not None else 0)
        for held in self.door.release(now, self.scheduler.running, self.sessions, self.scheduler.order(now),
                                      loanable):
            session = self.sessions.get(held.session_id) if self.sessions and held.session_id else None
            self._start(held.seq, session, held.num_new_tokens, now)

    def _update_door(self, arriving_tokens: int, now: float) -> None:
        """With admission "auto", the door enforces its budget while recomputing an admitted session's
        context costs more engine time than an agent's typical tool wait (both measured here; `door_pays`).
        When it starts to, the sessions that went in beyond the budget lose their places (`door.enforce`)."""
        door = self.door
        if door is None or not door.auto or self.sessions is None:
            return
        waits = self.sessions.predictor.overall()
        pays = door_pays(self.prefill_s_per_token, door.context_tokens(arriving_tokens),
                         waits.p50_s if waits is not None else None)
        if pays != door.enforcing:
            if pays:
                door.enforce(now, self.scheduler.running, self.sessions)
            door.enforcing = pays
            self._share_members()

    def _share_members(self) -> None:
        """Show the residency policy who has a place at the door while it holds turns: the others' KV leaves
        first when memory is short (a loaned turn's session, one whose turn waits to go in)."""
        if self.sessions is not None:
            door = self.door
            self.sessions.members = door.admitted.keys() if door is not None and door.enforcing else None

    def _prefill_tokens(self) -> int | None:
        """The prompt tokens a step may batch with decodes: config max_prefill_step_s at the measured cost per
        token (at least a block's worth, so prompts still advance); None: no such bound, or no cost yet."""
        target = self.scheduler.config.max_prefill_step_s
        if target is None or self.prefill_s_per_token is None:
            return None
        return max(self.kv.block_size, int(target / self.prefill_s_per_token))

    def _observe_step_time(self, plan: SchedulerOutput, seconds: float) -> None:
        """Fold a step's time into the measured costs: decode steps (the unit of a draft's cost, and where
        verifying drafts stops being free) and prefill seconds per token (what a recompute costs)."""
        if all(c.num_tokens - c.num_spec == 1 for c in plan.chunks):  # decodes only
            self.execute_s = seconds if self.execute_s is None else 0.9 * self.execute_s + 0.1 * seconds
            self.step_fit.observe(plan.num_batched_tokens, seconds)
        if plan.num_batched_tokens >= 64:
            sample = seconds / plan.num_batched_tokens
            prev = self.prefill_s_per_token
            self.prefill_s_per_token = sample if prev is None else 0.8 * prev + 0.2 * sample

    def _output(self, chunk: ScheduledChunk, result: ExecutorOutput, num_before: dict[Sequence, int],
                now: float) -> StepOutput | None:
        """What a chunk's sequence got this step (None: no token, or aborted while the step ran): its token,
        with a speculative chunk's accepted drafts before it, cut where a stop ended the sequence."""
        seq = chunk.seq
        token = result.sampled.get(seq.request_id)
        if token is None or seq.status is SequenceStatus.FINISHED_ABORTED:
            return None
        if seq.first_token_s is None:
            seq.first_token_s = now
        if seq.sampling_params.logprobs is not None:
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(result.logprobs.get(seq.request_id, {}))
        new_ids = [token]
        if chunk.num_spec:
            num_accepted = len(result.accepted.get(seq.request_id, []))
            seq.spec_acceptance = self.spec_policy.update(seq.spec_acceptance, chunk.num_spec, num_accepted)
            self.num_spec_proposed += chunk.num_spec
            self.num_spec_accepted += num_accepted
            self.num_spec_steps += 1
            new_ids = (result.accepted.get(seq.request_id, []) + [token])[:seq.num_tokens - num_before[seq]]
        return StepOutput(seq, new_ids, seq.is_finished)
