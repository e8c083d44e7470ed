"""Per-step timing records (model time, each tool call, critical path, queueing) and their OpenTelemetry spans.

Times are `time.monotonic()` seconds. A step costs its model call plus its
tool phase; the tool phase should cost its critical path (the longest chain
of dependent calls), not the sum of the calls. `overhead_s` is what the
runtime added on top of the critical path: queueing behind concurrency
limits, thread hand-offs, backoff waits.

Spans are built after the fact from these records with explicit timestamps,
so tracing never sits on the path of a step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode


@dataclass(slots=True)
class ToolCallRecord:
    """One logical tool call: when it became ready (its wave started), ran, and ended."""

    call_id: str
    name: str
    wave: int = 0
    ready_s: float = 0.0  # dependencies done; from here on it waits only on the runtime
    started_s: float = 0.0  # first attempt started (after the concurrency limit let it in)
    finished_s: float = 0.0
    num_attempts: int = 0
    is_ok: bool = False
    is_retry: bool = False  # the model asked again for a call that failed earlier in the run
    error: str | None = None

    @property
    def duration_s(self) -> float:
        return self.finished_s - self.started_s

    @property
    def queued_s(self) -> float:
        return self.started_s - self.ready_s


@dataclass(slots=True)
class StepRecord:
    """One step: a model call, then (when it asked for them) its tool calls."""

    step: int
    started_s: float = 0.0
    model_started_s: float = 0.0
    model_finished_s: float = 0.0
    model_attempts: int = 0
    num_cached_tokens: int = 0
    is_replan: bool = False  # this step's model call retried after a tool failure
    expected_wait_s: float | None = None  # what the session was told while parked
    tools_started_s: float | None = None
    tools_finished_s: float | None = None
    critical_path_s: float = 0.0
    tool_calls: list[ToolCallRecord] = field(default_factory=list)

    @property
    def model_s(self) -> float:
        return self.model_finished_s - self.model_started_s

    @property
    def tools_s(self) -> float:
        """Wall time of the tool phase (0 when the step called no tools)."""
        if self.tools_started_s is None or self.tools_finished_s is None:
            return 0.0
        return self.tools_finished_s - self.tools_started_s

    @property
    def sum_tool_s(self) -> float:
        """What the tool phase would cost run one call after another."""
        return sum(c.duration_s for c in self.tool_calls)

    @property
    def queued_s(self) -> float:
        return sum(c.queued_s for c in self.tool_calls)

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.tools_s - self.critical_path_s)

    @property
    def step_s(self) -> float:
        return max(self.model_finished_s, self.tools_finished_s or 0.0) - self.started_s

    def summary(self) -> dict[str, Any]:
        return {"step": self.step, "model_s": round(self.model_s, 6), "tools_s": round(self.tools_s, 6),
                "critical_path_s": round(self.critical_path_s, 6), "sum_tool_s": round(self.sum_tool_s, 6),
                "queued_s": round(self.queued_s, 6), "num_tool_calls": len(self.tool_calls),
                "model_attempts": self.model_attempts, "is_replan": self.is_replan}


class RunTracer:
    """Turns step records into spans: `agent.run` > `agent.step` > `agent.model`, `agent.tool`."""

    def __init__(self, tracer_provider: Any = None) -> None:
        provider = tracer_provider or trace.get_tracer_provider()
        self.tracer = provider.get_tracer("sessionserve.agent")
        # Monotonic to wall-clock nanoseconds; fixed once so spans of one run line up.
        self._offset_ns = time.time_ns() - int(time.monotonic() * 1e9)

    def _ns(self, t_s: float) -> int:
        return self._offset_ns + int(t_s * 1e9)

    def export(self, steps: list[StepRecord], started_s: float, finished_s: float,
               attributes: dict[str, Any] | None = None) -> None:
        attrs = {k: v for k, v in (attributes or {}).items() if v is not None}
        run = self.tracer.start_span("agent.run", start_time=self._ns(started_s), attributes=attrs)
        ctx = trace.set_span_in_context(run)
        for rec in steps:
            self._export_step(rec, ctx)
        run.set_attribute("agent.num_steps", len(steps))
        run.end(end_time=self._ns(finished_s))

    def _export_step(self, rec: StepRecord, parent: Any) -> None:
        end_s = max(rec.model_finished_s, rec.tools_finished_s or 0.0)
        step = self.tracer.start_span("agent.step", context=parent, start_time=self._ns(rec.started_s), attributes={
            "agent.step": rec.step, "agent.model_s": rec.model_s, "agent.tools_s": rec.tools_s,
            "agent.critical_path_s": rec.critical_path_s, "agent.sum_tool_s": rec.sum_tool_s,
            "agent.queued_s": rec.queued_s, "agent.is_replan": rec.is_replan,
            "agent.num_tool_calls": len(rec.tool_calls)})
        if rec.expected_wait_s is not None:
            step.set_attribute("sessionserve.expected_wait_s", rec.expected_wait_s)
        ctx = trace.set_span_in_context(step)
        model = self.tracer.start_span("agent.model", context=ctx, start_time=self._ns(rec.model_started_s),
                                       attributes={"agent.attempts": rec.model_attempts,
                                                   "sessionserve.cached_tokens": rec.num_cached_tokens})
        model.end(end_time=self._ns(rec.model_finished_s))
        for call in rec.tool_calls:
            span = self.tracer.start_span("agent.tool", context=ctx, start_time=self._ns(call.ready_s), attributes={
                "gen_ai.tool.name": call.name, "gen_ai.tool.call.id": call.call_id, "agent.wave": call.wave,
                "agent.queued_s": call.queued_s, "agent.attempts": call.num_attempts, "agent.is_retry": call.is_retry})
            if not call.is_ok:
                span.set_status(Status(StatusCode.ERROR, call.error or "failed"))
            span.end(end_time=self._ns(call.finished_s))
        step.end(end_time=self._ns(end_s))
