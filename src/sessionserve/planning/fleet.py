"""A fleet of simulated replicas behind a router, on one virtual timeline.

Each replica is a `SimEngine` with its own virtual clock (replicas run side by
side, each on its own accelerator); the replay takes events and engine steps
in time order across all of them: a step runs on the replica whose clock is
earliest, and an event (a session starting, an agent back from its tools) is
handled once every busy replica has reached its time. Every step of a
session is routed as an HTTP client's request is: the router sees the
prompt's block hashes, the session key and each replica's load, and picks a
replica. The client sends the whole history every step; a replica that holds
a copy of the session continues it (as the server's `continue_session` does:
the copy is a prefix of the prompt), so it computes the steps it missed, and
one that holds none opens a session and its prefix cache finds what it can.
The replica a session left keeps its copy parked, as a server does until the
idle TTL, and may get the session back.

Routers: `session` is our routing policy (`router.policy.choose_replica`, the
code the Ray Serve router runs); `p2c` is Ray Serve's default, power of two
choices (two random replicas, the one with fewer requests in flight);
`sticky` (consistent hashing on the session id), `prefix` (longest cached
prefix, ties to the least loaded) and `prefix-load` (cached prefix weighed
against requests in flight) are `router.policy`'s baselines.

The result is one `ReplayResult` for the fleet; workload metrics and reports
apply unchanged. Closed or open loop as the bench; sub-agents are not
replayed here.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from sessionserve.cache.block_hash import extend_block_hashes
from sessionserve.router import policy as rp
from sessionserve.planning.driver import IDLE_TICK_S, SimStalled, schedule_load, step_result
from sessionserve.sim.engine import SimEngine
from sessionserve.types.sampling_params import SamplingParams
from sessionserve.workload.inproc import fold_session_stats
from sessionserve.workload.prompts import PromptBuilder
from sessionserve.workload.replay import LoadSpec, ReplayResult, SessionRecord, StepRecord
from sessionserve.workload.trace import AgentSession

ROUTERS = ("session", "p2c", *rp.BASELINES)
# A fleet whose replicas have work but produce nothing for this long (simulated seconds) is stuck.
STALL_S = 600.0

class Router:
    """Routes each step of a session to a replica: `route` (request, replica loads) -> replica index."""

    def route(self, key: rp.RouteKey, loads: list[rp.ReplicaLoad]) -> int:
        raise NotImplementedError

    def forget(self, session_key: str) -> None:
        """The session ended."""


class SessionRouter(Router):
    """A policy of `router.policy`, as the Ray Serve router runs it: ours ("session_kv": affinity, cached
    prefix, load) or a baseline ("sticky", "prefix", "prefix-load")."""

    def __init__(self, config: rp.PolicyConfig | None = None, mode: str = "session_kv") -> None:
        self.config = config or rp.PolicyConfig()
        self.state = rp.RouterState.create(self.config)
        self.mode = mode

    def route(self, key: rp.RouteKey, loads: list[rp.ReplicaLoad]) -> int:
        decision = rp.decide(self.mode, key, loads, self.state, self.config)
        assert decision is not None
        rp.apply(self.state, key, decision.replica_id)
        return int(decision.replica_id)

    def forget(self, session_key: str) -> None:
        rp.forget_session(self.state, session_key)


class PowerOfTwoRouter(Router):
    """Ray Serve's default: two replicas at random, the one with fewer requests in flight."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def route(self, key: rp.RouteKey, loads: list[rp.ReplicaLoad]) -> int:
        picks = self.rng.sample(range(len(loads)), min(2, len(loads)))
        return min(picks, key=lambda i: (loads[i].num_queued, self.rng.random()))


def make_router(name: str, seed: int = 0) -> Router:
    if name == "session":
        return SessionRouter()
    if name == "p2c":
        return PowerOfTwoRouter(seed)
    if name in rp.BASELINES:
        return SessionRouter(mode=name)
    raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")


@dataclass(slots=True)
class _Live:
    trace: AgentSession
    record: SessionRecord
    history: list[int] = field(default_factory=list)  # what the client would resend: prompts and outputs
    hashes: list[bytes] = field(default_factory=list)  # its full blocks' chained hashes, as the router keys them
    homes: dict[int, str] = field(default_factory=dict)  # replica -> the engine session it holds for this one
    step_index: int = 0
    step_start_s: float = 0.0
    num_new_tokens: int = 0
    num_opened: int = 0
    replica: int = -1  # where its last step ran


class FleetReplay:
    """One replay of `sessions` under `load` on `engines` (fresh, owned by the caller) behind `router`."""

    def __init__(self, engines: Sequence[SimEngine], sessions: Sequence[AgentSession], load: LoadSpec,
                 router: Router, seed: int = 0, max_queued: int = 64) -> None:
        if not engines:
            raise ValueError("a fleet needs at least one replica")
        self.engines = list(engines)
        self.sessions = list(sessions)
        self.load = load
        self.router = router
        self.seed = seed
        self.max_queued = max_queued
        self.builder = PromptBuilder(engines[0].profile.model.vocab_size, seed)
        self.records: list[SessionRecord] = []
        self.steps: list[StepRecord] = []
        self._events: list[tuple[float, int, str, object]] = []
        self._order = 0
        self._queue: list[AgentSession] = []
        self._waiting: dict[tuple[int, str], _Live] = {}  # (replica, request id) -> session whose step it is
        self._stats: dict[str, dict[str, float]] = {}
        self.num_moves = 0  # steps sent to a replica other than the one that ran the session's last step
        self.num_history_tokens = 0  # earlier steps' tokens sent to replicas whose copy (if any) lacked them

    def _at(self, t_s: float, kind: str, data: object) -> None:
        self._order += 1
        heapq.heappush(self._events, (t_s, self._order, kind, data))

    def run(self) -> ReplayResult:
        t0 = max(e.clock() for e in self.engines)
        for e in self.engines:
            e.clock.advance_to(t0)
        self._queue = schedule_load(self._at, self.sessions, self.load, self.seed, t0)
        progress_s = t0
        while True:
            busy = [(e.clock(), i) for i, e in enumerate(self.engines) if e.has_unfinished()]
            t_busy, i_busy = min(busy) if busy else (float("inf"), -1)
            t_event = self._events[0][0] if self._events else float("inf")
            t_wake, i_wake = self._next_wake()
            if not busy and not self._events:
                break  # every session is done (a live one has a step in flight or an event pending)
            if t_event <= t_busy and t_event <= t_wake:
                _, _, kind, data = heapq.heappop(self._events)
                self._handle(t_event, kind, data)
                progress_s = t_event
                continue
            i = i_busy if t_busy <= t_wake else i_wake
            eng = self.engines[i]
            eng.clock.advance_to(min(t_busy, t_wake))
            before = eng.clock()
            outs = eng.step()
            if eng.clock() == before and eng.has_unfinished():
                # Nothing could run (a restore under way, no room yet): on to its next move's end or idle tick,
                # not past the next event.
                later = [before + IDLE_TICK_S, t_event]
                if eng.mover is not None and eng.mover.next_done_s() is not None:
                    later.append(max(before, eng.mover.next_done_s()))
                eng.clock.advance_to(min(later))
            for out in outs:
                live = self._waiting.pop((i, out.seq.request_id), None) if out.finished else None
                if live is not None:
                    self._step_done(i, live, out.seq)
            if outs:
                progress_s = eng.clock()
            elif busy and eng.clock() - progress_s > STALL_S:
                raise SimStalled(f"replica {i} made no progress for {STALL_S:g} simulated seconds at "
                                 f"t={eng.clock():.1f} s")
        makespan = max((r.end_s for r in self.records if r.end_s is not None), default=t0) - t0
        busy_s = sum(e.executor.busy_s for e in self.engines)
        return ReplayResult(self.load, self.records, self.steps, [], makespan, busy_s=busy_s, cpu_s=None,
                            extra={"replicas": len(self.engines), "moves": self.num_moves,
                                   "history_tokens_resent": self.num_history_tokens})

    def _next_wake(self) -> tuple[float, int]:
        """The earliest time an idle replica has something to do on its own (a move ending, a residency
        decision coming due), and which."""
        best = (float("inf"), -1)
        for i, e in enumerate(self.engines):
            if e.has_unfinished():
                continue
            now = e.clock()
            times = []
            if e.mover is not None and e.mover.next_done_s() is not None:
                times.append(e.mover.next_done_s())
            wake = e.sessions.next_wakeup_s(now)
            if wake is not None:
                times.append(max(wake, now + IDLE_TICK_S))
            if times and min(times) < best[0]:
                best = (min(times), i)
        return best

    def _handle(self, t_s: float, kind: str, data: object) -> None:
        if kind == "agent":
            if self._queue:
                self._start(self._queue.pop(), t_s)
        elif kind == "arrive":
            assert isinstance(data, AgentSession)
            self._start(data, t_s)
        else:
            assert isinstance(data, _Live)
            self._send_step(t_s, data)

    # -- sessions -------------------------------------------------------------------------------

    def _start(self, trace: AgentSession, t_s: float) -> None:
        rec = SessionRecord(trace.session_id, t_s, t_s, priority=trace.priority)
        self.records.append(rec)
        self._stats[trace.session_id] = {}
        self._send_step(t_s, _Live(trace, rec))

    def _loads(self) -> list[rp.ReplicaLoad]:
        out = []
        for i, e in enumerate(self.engines):
            sch = e.core.scheduler
            out.append(rp.ReplicaLoad(str(i), num_queued=len(sch.running) + len(sch.waiting),
                                      max_queued=self.max_queued, num_free_blocks=e.kv.num_free_blocks,
                                      num_total_blocks=e.kv.pool.num_blocks,
                                      num_parked_sessions=len(e.sessions.sessions)))
        return out

    def _send_step(self, t_s: float, live: _Live) -> None:
        trace, k = live.trace, live.step_index
        step = trace.steps[k]
        new_ids = self.builder.step_tokens(trace.session_id, k, step)
        kept = step.context_kept_tokens
        bs = self.engines[0].kv.block_size
        if kept is not None and kept < len(live.history):  # the client cut its context: no copy matches now
            del live.history[kept:]
            del live.hashes[kept // bs:]
            self._close_homes(live)
        prompt = live.history + new_ids
        # The history only grows between cuts: its full blocks keep their hashes, so each step hashes its own.
        key = rp.RouteKey(session_key=trace.session_id,
                          block_hashes=tuple(extend_block_hashes(live.hashes, prompt, bs)))
        loads = self._loads()
        i = self.router.route(key, loads)
        eng = self.engines[i]
        eng.clock.advance_to(t_s)
        esid = live.homes.get(i)
        session = eng.get_session(esid) if esid is not None else None
        if live.replica >= 0 and i != live.replica:
            self.num_moves += 1
        if session is None:
            live.num_opened += 1
            esid = live.homes[i] = eng.open_session(f"{trace.session_id}@{i}#{live.num_opened}", trace.priority)
            held = 0
        else:  # its copy there is the history up to the last step it ran there: the server continues it
            held = len(session.token_ids)
        ids = prompt[held:]
        self.num_history_tokens += len(live.history) - held
        live.num_new_tokens = len(new_ids)
        live.step_start_s = t_s
        live.replica = i
        params = SamplingParams(max_tokens=step.output_tokens, temperature=0, ignore_eos=True)
        try:
            rid = eng.add_request(ids, params, session_id=esid)
        except ValueError as exc:  # too long for the model: the session fails, as in the bench
            live.record.error = f"{type(exc).__name__}: {exc}"
            self._end(live)
            return
        live.history = prompt
        self._waiting[(i, rid)] = live

    def _step_done(self, i: int, live: _Live, seq) -> None:
        end_s = seq.finished_s
        # Timed from the client's send, not the replica's arrival: a replica mid-step when the request came
        # took it at the step's end.
        self.steps.append(StepRecord(live.trace.session_id, live.step_index, live.step_start_s,
                                     live.num_new_tokens, step_result(seq, live.step_start_s)))
        live.history.extend(seq.output_token_ids)
        live.record.num_steps += 1
        k = live.step_index
        step = live.trace.steps[k]
        if k + 1 < len(live.trace.steps):
            self.engines[i].park(live.homes[i], step.tool_names)
            live.record.total_wait_s += step.wait_s
            live.step_index += 1
            self._at(end_s + step.wait_s, "resume", live)
        else:
            live.record.end_s = end_s
            self._end(live)

    def _end(self, live: _Live) -> None:
        self._close_homes(live)
        self.router.forget(live.trace.session_id)
        live.record.stats = self._stats.pop(live.trace.session_id)
        if self.load.mode == "closed":
            self._at(live.record.end_s if live.record.end_s is not None else live.step_start_s, "agent", None)

    def _close_homes(self, live: _Live) -> None:
        for i, esid in live.homes.items():
            if self.engines[i].get_session(esid) is not None:
                self._fold(i, live, esid)
                self.engines[i].close_session(esid)
        live.homes.clear()

    def _fold(self, i: int, live: _Live, esid: str) -> None:
        fold_session_stats(self.engines[i], esid, self._stats[live.trace.session_id])


def simulate_fleet(engines: Sequence[SimEngine], sessions: Sequence[AgentSession], load: LoadSpec, router: str,
                   *, seed: int = 0, max_queued: int = 64) -> ReplayResult:
    """Replay `sessions` under `load` on `engines` behind the router named `router` (see `ROUTERS`)."""
    return FleetReplay(engines, sessions, load, make_router(router, seed), seed, max_queued).run()
