"""`InprocBackend`: the replay's backend on an `LLMEngine` in this process.

The engine steps in one worker thread (`run_in_executor`), so the asyncio
loop stays free for agents sleeping through tool waits. Agents never touch
the engine while a step runs: their calls are queued as operations that the
engine loop applies between two steps, in the loop's thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from sessionserve.obs.cpu_roles import release_compute_threads
from sessionserve.types.sampling_params import SamplingParams
from sessionserve.workload.backend import StepResult

if TYPE_CHECKING:
    from sessionserve.llm_engine import LLMEngine, RequestOutput

# NOTE: an idle engine still steps now and then, so residency policies get their ticks (prefetch before a
# tool wait ends, TTL expiry) while every agent sleeps.
IDLE_TICK_S = 0.005
KV_SAMPLE_PERIOD_S = 0.25


class InprocBackend:
    """Drives `engine` (owned by the caller, who closes it). One replay at a time."""

    name = "inproc"

    def __init__(self, engine: LLMEngine, hint_waits: bool = False) -> None:
        self.engine = engine
        self.vocab_size = engine.runner.arch.vocab_size
        self.hint_waits = hint_waits  # pass the true wait as `expected_wait_s` (an oracle hint)
        self._ops: list[tuple[Callable[[], Any], asyncio.Future]] = []
        self._waiters: dict[str, asyncio.Future] = {}
        self._engine_ids: dict[str, str] = {}  # trace session id -> current engine session id
        self._priority: dict[str, str] = {}  # trace session id -> scheduling class
        self._stats: dict[str, dict[str, float]] = {}  # counters of engine sessions already closed
        self._num_resets = 0
        self._busy_s = 0.0
        self._kv: dict[str, int] | None = None
        self._next_kv_s = 0.0
        self._wake: asyncio.Event | None = None
        self._stopping = False
        self._task: asyncio.Task | None = None
        self._pool: ThreadPoolExecutor | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engine")
        release_compute_threads()  # the engine steps on the pool's thread now (obs.cpu_roles)
        self._wake = asyncio.Event()
        self._stopping = False
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self._stopping = True
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            await self._task
        if self._pool is not None:
            self._pool.shutdown()

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` in the loop's thread between two engine steps; return its result."""
        fut = asyncio.get_running_loop().create_future()
        self._ops.append((fn, fut))
        assert self._wake is not None
        self._wake.set()
        return await fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        eng = self.engine
        assert self._wake is not None
        try:
            while not self._stopping:
                ops, self._ops = self._ops, []
                for fn, fut in ops:
                    try:
                        fut.set_result(fn())
                    except Exception as exc:  # noqa: BLE001 - the caller gets it
                        fut.set_exception(exc)
                now = time.monotonic()
                if now >= self._next_kv_s:
                    self._kv = self._sample_kv()
                    self._next_kv_s = now + KV_SAMPLE_PERIOD_S
                has_work = eng.has_unfinished()
                t0 = time.perf_counter()
                outs = await loop.run_in_executor(self._pool, eng.step)
                if has_work:
                    self._busy_s += time.perf_counter() - t0
                for out in outs:
                    if out.finished and out.request_id in self._waiters:
                        self._waiters.pop(out.request_id).set_result(out)
                if not outs and not eng.has_unfinished() and not self._ops:
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), IDLE_TICK_S)
                    except asyncio.TimeoutError:
                        pass
        except BaseException as exc:
            for fut in self._waiters.values():
                if not fut.done():
                    fut.set_exception(RuntimeError(f"engine loop failed: {exc!r}"))
            raise

    # -- sessions -------------------------------------------------------------------------------

    async def open_session(self, session_id: str, priority: str = "interactive") -> None:
        self._priority[session_id] = priority
        self._engine_ids[session_id] = await self._call(lambda: self.engine.open_session(session_id, priority=priority))
        self._stats[session_id] = {}

    def _add(self, session_id: str, new_ids: list[int], max_tokens: int, kept: int | None) -> asyncio.Future:
        eng = self.engine
        esid = self._engine_ids[session_id]
        session = eng.get_session(esid)
        if session is None:
            raise RuntimeError(f"session {esid!r} expired while idle")
        if kept is not None and kept < len(session.token_ids):
            # NOTE: the engine's sessions only grow, so a client that cuts its context (compaction) becomes a
            # fresh engine session sent the kept prefix again; prefix caching may still find those blocks.
            new_ids = list(session.token_ids[:kept]) + new_ids
            self._fold_stats(session_id, esid)
            eng.close_session(esid)
            self._num_resets += 1
            esid = eng.open_session(f"{session_id}#{self._num_resets}", priority=self._priority[session_id])
            self._engine_ids[session_id] = esid
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        rid = eng.add_request(new_ids, params, session_id=esid)
        fut = self._waiters[rid] = asyncio.get_running_loop().create_future()
        return fut

    async def generate(self, session_id: str, step_index: int, new_token_ids: list[int], max_tokens: int,
                       context_kept_tokens: int | None = None) -> StepResult:
        done = await self._call(lambda: self._add(session_id, new_token_ids, max_tokens, context_kept_tokens))
        out: RequestOutput = await done
        n = len(out.token_ids)
        end_s = out.finished_s if out.finished_s is not None else time.monotonic()
        ttft = None if out.first_token_s is None else out.first_token_s - out.arrival_s
        tpot = (end_s - out.first_token_s) / (n - 1) if out.first_token_s is not None and n > 1 else None
        return StepResult(list(out.token_ids), end_s - out.arrival_s, ttft, tpot, len(out.prompt_token_ids),
                          out.num_cached_tokens)

    async def park(self, session_id: str, tools: tuple[str, ...], expected_wait_s: float | None) -> None:
        hint = expected_wait_s if self.hint_waits else None
        esid = self._engine_ids[session_id]
        await self._call(lambda: self.engine.park(esid, tools, hint))

    def _fold_stats(self, session_id: str, esid: str) -> None:
        fold_session_stats(self.engine, esid, self._stats[session_id])

    async def close_session(self, session_id: str) -> dict[str, float]:
        esid = self._engine_ids.pop(session_id)

        def close() -> None:
            self._fold_stats(session_id, esid)
            self.engine.close_session(esid)

        await self._call(close)
        return self._stats.pop(session_id)

    # -- observation ----------------------------------------------------------------------------

    def _sample_kv(self) -> dict[str, int]:
        u = self.engine.kv_usage()
        block_bytes = u.get("block_bytes", 0)
        sample = {"device_bytes": u.get("device_blocks_used", 0) * block_bytes,
                  "device_bytes_total": u.get("device_blocks_total", 0) * block_bytes,
                  "host_bytes": u.get("host_blocks_used", 0) * block_bytes,
                  "disk_bytes": u.get("disk_bytes_used", 0)}
        sample.update({k: v for k, v in u.items() if k.startswith("sessions_")})
        return sample

    def kv_usage(self) -> dict[str, int] | None:
        return self._kv

    def busy_s(self) -> float | None:
        return self._busy_s


def fold_session_stats(engine: Any, engine_session_id: str, acc: dict[str, float]) -> None:
    """Add the counters of an engine session (real or simulated) to `acc`, by SessionStats field name."""
    session = engine.get_session(engine_session_id)
    if session is None:
        return
    for f in fields(session.stats):
        acc[f.name] = acc.get(f.name, 0) + getattr(session.stats, f.name)
