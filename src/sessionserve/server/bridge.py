"""The async bridge: the engine runs in its own thread; coroutines submit work and await outputs.

The event loop never blocks on compute. Requests and session commands go to
the engine thread through one queue and are applied between steps; each
request's outputs come back on its own asyncio queue. A request whose inputs
make a step fail gets the error alone (the engine runs the others on); a
step that fails outside that fails its running requests, and the engine goes on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

# The engine's own names the server uses (its errors and session states) come through here: the server
# reaches the engine's core only through the bridge (an import contract).
from sessionserve.core.admission import AdmissionFull
from sessionserve.core.session import Session, SessionState
from sessionserve.core.session_manager import SessionBusyError, SessionMovingError
from sessionserve.llm_engine import LLMEngine, RequestOutput
from sessionserve.model.grammar_worker import GrammarBusy
from sessionserve.obs.cpu_roles import pin_current_thread, release_compute_threads
from sessionserve.types.sampling_params import SamplingParams
from sessionserve.types.sequence import ParkHint

__all__ = ["STALLED_WAIT_S", "AdmissionFull", "AsyncEngine", "EngineDead", "EngineOverloaded", "GrammarBusy",
           "OutputStream", "Session", "SessionBusyError", "SessionMovingError", "SessionState", "Turn"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
# How long the loop waits for a command when requests wait but none could run (held at the admission door,
# or waiting for KV): not a busy spin, and short enough that a freed slot is used at once.
STALLED_WAIT_S = 0.005


@dataclass(frozen=True)
class Turn:
    """What a request's prepare step may return: the tokens to send and the session they go to."""

    token_ids: list[int]
    session_id: str | None


class EngineOverloaded(Exception):
    """Too many requests queued; the client should retry later."""


class EngineDead(Exception):
    """The engine thread is not running."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    request_id: str


class AsyncEngine:
    """Runs `LLMEngine.step()` in a dedicated thread; thread-safe, awaitable API."""

    def __init__(self, engine: LLMEngine, max_queued_requests: int = 1024, idle_tick_s: float = 0.02,
                 on_step: Callable[[LLMEngine, float, float], None] | None = None,
                 cpus: frozenset[int] | None = None, on_gauges: Callable[[LLMEngine], None] | None = None,
                 idle_sample_s: float = 1.0, busy_sample_s: float = 0.1) -> None:
        """`cpus`: cores the engine thread (and the compute threads it starts) is pinned to; None: any.
        `on_gauges(engine)` runs in the engine thread at most every `busy_sample_s` while steps run, once as
        they stop, every `idle_sample_s` while no step has work (a session that expires changes them), and
        after a failed step. Not after every step: reading every gauge (the sessions' totals among them)
        took a tenth of the server's interpreter time under load."""
        self.engine = engine
        self.cpus = cpus
        self.max_queued_requests = max_queued_requests
        self._num_adding = 0  # requests whose `add` is queued for the engine thread (event-loop side)
        self.idle_tick_s = idle_tick_s
        # Metrics hook, called in the engine thread after each step: (engine, wall s, the engine thread's CPU s;
        # with more than one torch thread the other compute threads' CPU is not in it).
        self.on_step = on_step
        self.on_gauges = on_gauges
        self.idle_sample_s = idle_sample_s
        self.busy_sample_s = busy_sample_s
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._stop = threading.Event()
        self._draining = False
        self.num_step_errors = 0  # steps that raised out of the engine: every running request failed
        self.num_failed_requests = 0  # requests that failed a step alone (the engine ran the others on)
        # From now on the engine is stepped on its own thread: the compute threads this one started (loading
        # the model) go, else they and the engine thread's keep each other from spinning (obs.cpu_roles).
        release_compute_threads()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stop taking requests, let in-flight ones finish (up to the timeout), stop the thread."""
        self._draining = True
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self._streams):
            await self.abort(rid)
        self._stop.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10)
        self.engine.close()

    # -- API ---------------------------------------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` in the engine thread between steps; return its result or raise its error."""
        if not self.is_alive:
            raise EngineDead("the engine is not running")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        self._commands.put(run)
        return await fut

    async def submit(self, prompt: list[int] | Callable[[LLMEngine], list[int] | Turn], params: SamplingParams,
                     request_id: str, session_id: str | None = None, salt: bytes = b"", stream: bool = True,
                     priority: str | None = None, park_hint: ParkHint | None = None) -> OutputStream:
        """Add a request; returns once the engine has taken it (or raised why not). Iterate the result for
        its outputs (one per engine step it advanced) until it finishes.

        `prompt` may be a function of the engine, run in the engine thread right before the request is
        added (a session turn works out its new tokens there). Raises ValueError for bad input,
        EngineOverloaded when the queue is full, and whatever `prompt` raised. If the consumer stops
        iterating (client gone) or closes the stream, the request is aborted and its blocks freed.
        """
        if self._draining or not self.is_alive:
            raise EngineDead("the server is shutting down")
        in_flight = len(self._streams) + self._num_adding
        if in_flight >= self.max_queued_requests:
            raise EngineOverloaded(f"{in_flight} requests in flight")
        loop = asyncio.get_running_loop()
        own = _Stream(loop, asyncio.Queue(), request_id)

        def add(eng: LLMEngine) -> None:
            ids = prompt(eng) if callable(prompt) else prompt
            sid = session_id
            if isinstance(ids, Turn):
                ids, sid = ids.token_ids, ids.session_id
            eng.add_request(ids, params, request_id=request_id, stream=stream, salt=salt, session_id=sid,
                            priority=priority, park_hint=park_hint)
            self._streams[request_id] = own

        # Counted from now, not from when the engine thread gets to `add`: a burst that arrives while
        # the engine is busy must meet the limit too.
        self._num_adding += 1
        try:
            await self.call(add)
        except BaseException:
            # NOTE: a consumer cancelled while `add` waits for the engine thread (a client gone before the
            # first step) must still abort the request `add` then adds: queued after it (one FIFO queue).
            self._commands.put(lambda: self._abort_own(own))
            raise
        finally:
            self._num_adding -= 1
        return OutputStream(self, own)

    async def generate(self, prompt: list[int] | Callable[[LLMEngine], list[int] | Turn], params: SamplingParams,
                       request_id: str, session_id: str | None = None, salt: bytes = b"",
                       stream: bool = True, priority: str | None = None) -> AsyncIterator[RequestOutput]:
        """`submit` and iterate: the request's outputs until it finishes."""
        outputs = await self.submit(prompt, params, request_id, session_id, salt, stream, priority)
        try:
            async for out in outputs:
                yield out
        finally:
            outputs.close()

    async def abort(self, request_id: str) -> None:
        def do(eng: LLMEngine) -> None:
            self._streams.pop(request_id, None)
            eng.abort(request_id)

        if self.is_alive:
            await self.call(do)

    # -- engine thread -----------------------------------------------------------------------

    def _abort_own(self, stream: _Stream) -> None:
        """Abort `stream`'s request if it is still registered: never another request that reuses its id."""
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            self.engine.abort(stream.request_id)

    def _run(self) -> None:
        eng = self.engine
        pin_current_thread(self.cpus)
        last_sample = time.monotonic()
        unsampled = False  # a step ran since the gauges were last read
        stalled = False  # the last step ran nothing though requests wait (at the door, or for their KV)
        while not self._stop.is_set():
            busy = eng.has_unfinished()
            try:
                cmd = self._commands.get(timeout=(STALLED_WAIT_S if stalled else 0) if busy else self.idle_tick_s)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                try:
                    cmd()
                except Exception:  # noqa: BLE001 - one failed command (an abort) must not stop the engine
                    logger.exception("engine command failed")
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                outputs = eng.step()  # with nothing to run, this still ticks parked sessions
            except Exception as exc:  # noqa: BLE001 - one bad step must not kill the server
                self.num_step_errors += 1
                logger.exception("engine step failed; failing its requests")
                self._fail_running(exc)
                if self.on_gauges is not None:
                    self.on_gauges(eng)
                continue
            stalled = busy and not outputs and not eng.core.scheduler.running
            for out in outputs:
                s = self._streams.get(out.request_id)
                if s is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                if out.error is not None:  # this request alone failed the step (the others went on)
                    self.num_failed_requests += 1
                    s.loop.call_soon_threadsafe(s.queue.put_nowait, RuntimeError(f"engine step failed: {out.error}"))
                    continue
                s.loop.call_soon_threadsafe(s.queue.put_nowait, out)
            ran = bool(outputs or busy)
            if ran and self.on_step is not None:
                self.on_step(eng, time.perf_counter() - t0, time.thread_time() - c0)
            unsampled = unsampled or ran
            if self.on_gauges is not None and (
                    time.monotonic() - last_sample >= (self.busy_sample_s if ran else self.idle_sample_s)
                    or unsampled and not ran):
                self.on_gauges(eng)
                last_sample, unsampled = time.monotonic(), False

    def _fail_running(self, exc: Exception) -> None:
        eng = self.engine
        running = [s.request_id for s in eng.core.scheduler.running]
        for rid in running:
            eng.abort(rid)
            s = self._streams.pop(rid, None)
            if s is not None:
                s.loop.call_soon_threadsafe(s.queue.put_nowait, RuntimeError(f"engine step failed: {exc!r}"))


class OutputStream:
    """A started request's outputs. Iterate once; `close()` (or leaving the iteration early) aborts it."""

    def __init__(self, bridge: AsyncEngine, own: _Stream) -> None:
        self._bridge = bridge
        self._own = own
        self.finished = False
        self._on_end: list[Callable[[], None]] = []

    def on_end(self, fn: Callable[[], None]) -> None:
        """Call `fn` once when the request finishes or is closed (at once if it already has)."""
        if self.finished:
            fn()
        else:
            self._on_end.append(fn)

    def _end(self) -> None:
        self.finished = True
        callbacks, self._on_end = self._on_end, []
        for fn in callbacks:
            fn()

    @property
    def request_id(self) -> str:
        return self._own.request_id

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self._own.queue.get()
                if isinstance(item, BaseException):
                    self._end()  # the engine dropped it already
                    raise item
                if item.finished:
                    self._end()
                yield item
                if item.finished:
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Abort the request unless it finished. Safe to call more than once and from a cancelled task."""
        if not self.finished:
            self._end()
            # Queued without awaiting: a cancelled consumer cannot await.
            own = self._own
            self._bridge._commands.put(lambda: self._bridge._abort_own(own))


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
