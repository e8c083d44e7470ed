"""The event-driven replay on a virtual clock: the bench's workload semantics, no sleeps.

What `workload.replay.replay` does with asyncio on wall time, done with a
heap of events on the engine's `VirtualClock`: session starts (closed loop:
`concurrency` agents taking sessions in trace order; open loop: the same
arrival times), LLM steps (token ids from the same `PromptBuilder`, the same
context-cut handling as `InprocBackend`), tool waits. Engine steps advance
the clock by their predicted time. The result is a `ReplayResult`, so
`workload.metrics`, `results` and `report` apply unchanged.

Sub-agents start as their own sessions when their parent's step ends, as in
the bench's replay: the parent's next step waits for the blocking ones, then
for its own tool wait; they are recorded apart (`ReplayResult.subagents`).

Deterministic: the same trace, load, seed and profile give the same result.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sessionserve.sim.engine import SimEngine
from sessionserve.types.sampling_params import SamplingParams
from sessionserve.workload.backend import StepResult
from sessionserve.workload.inproc import fold_session_stats
from sessionserve.workload.prompts import PromptBuilder
from sessionserve.workload.replay import (
    KV_SAMPLE_PERIOD_S,
    LoadSpec,
    ReplayResult,
    SessionRecord,
    StepRecord,
    arrival_times,
)
from sessionserve.workload.trace import AgentSession

if TYPE_CHECKING:
    from sessionserve.types.sequence import Sequence as CoreSequence

# NOTE: the real loop steps an idle engine every IDLE_TICK_S so that time-triggered residency actions (a prefetch
# before a predicted resume, a TTL drop) happen on time. Here an idle engine steps only when the session manager
# says a tick can act (`SessionManager.next_wakeup_s`: the policy's next decision time, the next expiry), at least
# IDLE_TICK_S apart; moves in flight wake it when they finish. Same actions at the same virtual times, without the
# ticks in between that would decide nothing.
IDLE_TICK_S = 0.005
# A replay whose engine has work but produces nothing for this long (simulated seconds) is stuck, not slow.
STALL_S = 600.0


class SimStalled(RuntimeError):
    """The engine had queued work and made no progress for `STALL_S` simulated seconds."""


@dataclass(slots=True)
class _Live:
    """One trace session being replayed."""

    trace: AgentSession
    record: SessionRecord
    engine_sid: str
    step_index: int = 0
    step_start_s: float = 0.0
    num_new_tokens: int = 0
    num_resets: int = 0
    is_subagent: bool = False
    parent: _Live | None = None  # the session waiting for this sub-agent to end, if any
    num_blocking: int = 0  # sub-agents this session waits for before its next step


class SimReplay:
    """One replay of `sessions` under `load` on `engine` (fresh, owned by the caller)."""

    def __init__(self, engine: SimEngine, sessions: Sequence[AgentSession], load: LoadSpec, seed: int = 0,
                 hint_waits: bool = False, on_session_done: Callable[[SessionRecord], None] | None = None) -> None:
        self.engine = engine
        self.clock = engine.clock
        self.sessions = list(sessions)
        self.load = load
        self.hint_waits = hint_waits
        self.on_session_done = on_session_done
        self.builder = PromptBuilder(engine.profile.model.vocab_size, seed)
        self.seed = seed
        self.records: list[SessionRecord] = []
        self.subagents: list[SessionRecord] = []
        self.steps: list[StepRecord] = []
        self.kv_samples: list[dict[str, float]] = []
        self._events: list[tuple[float, int, str, object]] = []
        self._order = 0
        self._waiting: dict[str, _Live] = {}  # request id -> session whose step it is
        self._stats: dict[str, dict[str, float]] = {}
        self._queue: list[AgentSession] = []
        self._next_kv_s = 0.0
        self._num_live = 0

    # -- events ---------------------------------------------------------------------------------

    def _at(self, t_s: float, kind: str, data: object) -> None:
        self._order += 1
        heapq.heappush(self._events, (t_s, self._order, kind, data))

    def run(self) -> ReplayResult:
        t0 = self.clock()
        self._queue = schedule_load(self._at, self.sessions, self.load, self.seed, t0)
        eng = self.engine
        progress_s = self.clock()
        while self._events or eng.has_unfinished():
            while self._events and self._events[0][0] <= self.clock():
                _, _, kind, data = heapq.heappop(self._events)
                self._handle(kind, data)
                progress_s = self.clock()
            self._sample_kv()
            before = self.clock()
            outs = eng.step()
            for out in outs:
                if out.finished and out.seq.request_id in self._waiting:
                    self._step_done(self._waiting.pop(out.seq.request_id), out.seq)
            if outs or not eng.has_unfinished():
                progress_s = self.clock()
            if self.clock() == before and not self._has_ready_work() and self.clock() - progress_s > STALL_S:
                raise SimStalled(self._stall_message())
            if self.clock() == before and not self._has_ready_work() and (self._events or eng.has_unfinished()):
                self.clock.advance_to(self._next_time())
        self._sample_kv(force=True)
        makespan = self.clock() - t0
        return ReplayResult(self.load, self.records, self.steps, self.kv_samples, makespan,
                            busy_s=eng.executor.busy_s, cpu_s=None, subagents=self.subagents)

    def _stall_message(self) -> str:
        sch, kv = self.engine.core.scheduler, self.engine.kv
        head = sch.waiting[0] if sch.waiting else None
        need = "" if head is None else (f"; the first waiting request has {head.num_tokens} tokens "
                                        f"({kv.blocks_needed(head.num_tokens)} blocks)")
        return (f"the engine made no progress for {STALL_S:g} simulated seconds at t={self.clock():.1f} s: "
                f"{len(sch.running)} running, {len(sch.waiting)} waiting, {kv.num_free_blocks} of "
                f"{kv.pool.num_blocks} device blocks free{need}")

    def _has_ready_work(self) -> bool:
        return bool(self._events) and self._events[0][0] <= self.clock()

    def _next_time(self) -> float:
        """Where the clock goes when nothing ran: the next event, move completion or idle tick."""
        now = self.clock()
        candidates = [self._events[0][0]] if self._events else []
        mover = self.engine.mover
        if mover is not None and mover.next_done_s() is not None:
            candidates.append(mover.next_done_s())
        if self.engine.has_unfinished():
            candidates.append(now + IDLE_TICK_S)
        else:
            wake = self.engine.sessions.next_wakeup_s(now)
            if wake is not None:
                candidates.append(max(wake, now + IDLE_TICK_S))
        return min(candidates) if candidates else now + IDLE_TICK_S

    def _handle(self, kind: str, data: object) -> None:
        now = self.clock()
        if kind == "agent":
            if self._queue:
                self._start(self._queue.pop(), now)
        elif kind == "arrive":
            assert isinstance(data, AgentSession)
            self._start(data, now)
        elif kind == "resume":
            assert isinstance(data, _Live)
            self._send_step(data)

    # -- sessions -------------------------------------------------------------------------------

    def _start(self, trace: AgentSession, arrival_s: float, *, subagent: bool = False,
               parent: _Live | None = None) -> None:
        """Open a session and send its first step. `subagent`: recorded apart; `parent`: waits for it."""
        now = self.clock()
        rec = SessionRecord(trace.session_id, arrival_s - 0.0, now, priority=trace.priority)
        (self.subagents if subagent else self.records).append(rec)
        esid = self.engine.open_session(trace.session_id, trace.priority)
        self._stats[trace.session_id] = {}
        self._num_live += 1
        self._send_step(_Live(trace, rec, esid, is_subagent=subagent, parent=parent))

    def _send_step(self, live: _Live) -> None:
        """`InprocBackend._add`, on the sim engine: cut the context if the step says so, queue the turn."""
        eng, trace, k = self.engine, live.trace, live.step_index
        step = trace.steps[k]
        new_ids = self.builder.step_tokens(trace.session_id, k, step)
        live.num_new_tokens = len(new_ids)
        live.step_start_s = self.clock()
        session = eng.get_session(live.engine_sid)
        if session is None:  # closed while its agent waited (idle TTL): the session fails, as in the bench
            live.record.error = f"session {live.engine_sid!r} expired while idle"
            self._end(live)
            return
        kept = step.context_kept_tokens
        if kept is not None and kept < len(session.token_ids):
            new_ids = list(session.token_ids[:kept]) + new_ids
            self._fold_stats(trace.session_id, live.engine_sid)
            eng.close_session(live.engine_sid)
            live.num_resets += 1
            live.engine_sid = eng.open_session(f"{trace.session_id}#{live.num_resets}", trace.priority)
        params = SamplingParams(max_tokens=step.output_tokens, temperature=0, ignore_eos=True)
        try:
            rid = eng.add_request(new_ids, params, session_id=live.engine_sid)
        except ValueError as exc:  # too long for the model: the session fails, as in the bench
            live.record.error = f"{type(exc).__name__}: {exc}"
            self._end(live)
            return
        self._waiting[rid] = live

    def _step_done(self, live: _Live, seq) -> None:
        self.steps.append(StepRecord(live.trace.session_id, live.step_index, live.step_start_s,
                                     live.num_new_tokens, step_result(seq, seq.arrival_s)))
        live.record.num_steps += 1
        k = live.step_index
        step = live.trace.steps[k]
        if k + 1 < len(live.trace.steps):
            self.engine.park(live.engine_sid, step.tool_names,
                             live.trace.expected_wait_s(k) if self.hint_waits else None)
            live.record.total_wait_s += step.wait_s
            live.step_index += 1
            # Sub-agents start now, side by side; the blocking ones hold the next step until they end.
            children = live.trace.subagents_after(k)
            live.num_blocking = sum(1 for a in children if a.blocking)
            for a in children:
                self._start(a.session, self.clock(), subagent=True, parent=live if a.blocking else None)
            if live.num_blocking == 0:
                self._at(self.clock() + step.wait_s, "resume", live)
        else:
            live.record.end_s = self.clock()
            self._end(live)

    def _end(self, live: _Live) -> None:
        sid = live.trace.session_id
        self._fold_stats(sid, live.engine_sid)
        if self.engine.get_session(live.engine_sid) is not None:
            self.engine.close_session(live.engine_sid)
        live.record.stats = self._stats.pop(sid)
        self._num_live -= 1
        if live.is_subagent:
            parent = live.parent
            if parent is not None:
                parent.num_blocking -= 1
                if parent.num_blocking == 0:  # its sub-agents are back: then the rest of its wait
                    waited = parent.trace.steps[parent.step_index - 1].wait_s
                    self._at(self.clock() + waited, "resume", parent)
            return
        if self.load.mode == "closed":
            self._at(self.clock(), "agent", None)
        if self.on_session_done is not None:
            self.on_session_done(live.record)

    def _fold_stats(self, sid: str, esid: str) -> None:
        fold_session_stats(self.engine, esid, self._stats[sid])

    def _sample_kv(self, force: bool = False) -> None:
        now = self.clock()
        if now < self._next_kv_s and not force:
            return
        u = self.engine.kv_usage()
        bb = u["block_bytes"]
        sample = {"t_s": round(now, 3), "device_bytes": u["device_blocks_used"] * bb,
                  "device_bytes_total": u["device_blocks_total"] * bb,
                  "host_bytes": u.get("host_blocks_used", 0) * bb, "disk_bytes": u.get("disk_bytes_used", 0)}
        sample.update({k: v for k, v in u.items() if k.startswith("sessions_")})
        self.kv_samples.append(sample)
        self._next_kv_s = now + KV_SAMPLE_PERIOD_S


def schedule_load(at: Callable[[float, str, object], None], sessions: Sequence[AgentSession], load: LoadSpec,
                  seed: int, t0: float) -> list[AgentSession]:
    """The load's first events from `t0`: closed loop, an "agent" per concurrent agent, taking sessions from
    the returned queue (last first); open loop, each session's "arrive" (the queue is empty)."""
    arrivals = arrival_times(sessions, load, seed)
    if arrivals is not None:
        for trace, at_s in zip(sessions, arrivals):
            at(t0 + at_s, "arrive", trace)
        return []
    for _ in range(min(load.concurrency, len(sessions))):
        at(t0, "agent", None)
    return list(reversed(sessions))


def step_result(seq: CoreSequence, sent_s: float) -> StepResult:
    """A finished turn as the replay records it, its latencies counted from `sent_s` (the client's send)."""
    n, end_s, first_s = seq.num_output_tokens, seq.finished_s, seq.first_token_s
    ttft = None if first_s is None else first_s - sent_s
    tpot = (end_s - first_s) / (n - 1) if first_s is not None and n > 1 else None
    return StepResult(seq.output_token_ids, end_s - sent_s, ttft, tpot, seq.num_prompt_tokens,
                      seq.num_cached_tokens or 0)


def simulate(engine: SimEngine, sessions: Sequence[AgentSession], load: LoadSpec, *, seed: int = 0,
             hint_waits: bool = False, on_session_done: Callable[[SessionRecord], None] | None = None) -> ReplayResult:
    """Replay `sessions` under `load` on `engine`; returns the same `ReplayResult` as the bench's replay."""
    return SimReplay(engine, sessions, load, seed, hint_waits, on_session_done).run()
