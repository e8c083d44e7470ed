"""The agent loop: ask the model, run the tool calls it asks for, send the results, until it answers.

    for step in range(max_steps):
        reply = model(messages, tools, tool_choice(step))       # one logical model call
        if no tool calls: return the answer
        results = executor.run_plan(reply.tool_calls)           # concurrently, by dependency
        messages += results
        if a call failed: re-plan only if the shared budget has a retry, else make the model answer

On a sessionserve server the run holds a session: each model call carries
`X-Session-ID`, the server parks the session while the tools run (told how
long by `expected_wait_s`, learnt per tool) and resumes it from its KV when
the results arrive. On any other OpenAI-compatible server the same loop
sends plain chat completions.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from sessionserve.agent.client import ChatClient, ModelError
from sessionserve.agent.executor import PlannedCall, ToolExecutor, ToolResult
from sessionserve.agent.reply import ToolCall
from sessionserve.agent.timing import RunTracer, StepRecord
from sessionserve.agent.tools import ToolRegistry

ToolChoice = Union[str, dict[str, Any], None]


@dataclass(frozen=True)
class AgentConfig:
    max_steps: int = 10  # model calls per run
    # "auto" | "required" | "none" | {"type": "function", ...}; or a list (step i uses item i, "auto" after
    # the end); or a callable step -> choice. Forcing tools early suits models that only call them when told.
    tool_choice: ToolChoice | Sequence[ToolChoice] | Callable[[int], ToolChoice] = "auto"
    max_replans: int = 3  # re-plans after tool failures per run; each also needs the retry budget
    stream: bool = False
    use_sessions: bool = True  # open a session when the server has them
    close_session: bool = True  # close it when the run ends
    priority: str = "interactive"  # session priority on sessionserve: "interactive" | "batch"
    model_params: dict[str, Any] = field(default_factory=dict)  # extra body fields: max_tokens, temperature...

    def __post_init__(self) -> None:
        if self.max_steps < 1 or self.max_replans < 0:
            raise ValueError("max_steps must be >= 1 and max_replans >= 0")
        if self.priority not in ("interactive", "batch"):
            raise ValueError("priority must be 'interactive' or 'batch'")

    def tool_choice_at(self, step: int) -> ToolChoice:
        policy = self.tool_choice
        if callable(policy):
            return policy(step)
        if isinstance(policy, (list, tuple)):
            return policy[step] if step < len(policy) else "auto"
        return policy


@dataclass(frozen=True)
class AgentResult:
    answer: str | None
    stop_reason: str  # "answer" | "max_steps" | "model_error" | "retry_budget"
    messages: list[dict[str, Any]]
    steps: tuple[StepRecord, ...]
    session_id: str | None  # the server session the run used (None: plain chat completions)
    num_replans: int = 0
    error: str | None = None

    @property
    def num_tool_calls(self) -> int:
        return sum(len(s.tool_calls) for s in self.steps)


@dataclass(frozen=True)
class TextDelta:
    step: int
    text: str


@dataclass(frozen=True)
class ToolDone:
    step: int
    result: ToolResult


@dataclass(frozen=True)
class StepDone:
    record: StepRecord


@dataclass(frozen=True)
class RunDone:
    result: AgentResult


AgentEvent = Union[TextDelta, ToolDone, StepDone, RunDone]


def call_signature(call: ToolCall) -> tuple[str, str]:
    """Identity of a call across steps: name and canonical arguments (a repeat of a failed call is a retry)."""
    try:
        args = json.dumps(json.loads(call.arguments or "{}"), sort_keys=True)
    except json.JSONDecodeError:
        args = call.arguments
    return call.name, args


class Agent:
    """Runs tasks with a model client and a tool registry. One agent may run many tasks, also concurrently."""

    def __init__(self, client: ChatClient, tools: ToolRegistry, config: AgentConfig | None = None, *,
                 executor: ToolExecutor | None = None, tracer_provider: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.tools = tools
        self.config = config or AgentConfig()
        self.executor = executor or ToolExecutor(tools, budget=client.budget, clock=clock)
        if self.executor.budget is not client.budget:
            raise ValueError("the client and the executor must share one RetryBudget")
        self.budget = client.budget
        self.estimator = self.executor.estimator
        self.spans = RunTracer(tracer_provider)
        self.clock = clock

    def close(self) -> None:
        self.executor.close()

    async def stream(self, task: str | list[dict[str, Any]], **kwargs: Any) -> AsyncIterator[AgentEvent]:
        """`run`, as events: text deltas, tool results, step records as they happen; `RunDone` last."""
        queue: asyncio.Queue[AgentEvent] = asyncio.Queue()

        async def drive() -> None:
            queue.put_nowait(RunDone(await self.run(task, on_event=queue.put_nowait, **kwargs)))

        job = asyncio.ensure_future(drive())
        try:
            while True:
                get = asyncio.ensure_future(queue.get())
                await asyncio.wait({get, job}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():  # the run ended: its RunDone is queued, or it raised
                    get.cancel()
                    job.result()
                    continue
                event = get.result()
                yield event
                if isinstance(event, RunDone):
                    return
        finally:
            if not job.done():
                job.cancel()

    async def run(self, task: str | list[dict[str, Any]], *, session_id: str | None = None,
                  on_event: Callable[[AgentEvent], None] | None = None) -> AgentResult:
        """Run one task (a user message, or a whole message list) to an answer or the step limit."""
        cfg = self.config
        emit = on_event or (lambda _event: None)
        messages = [{"role": "user", "content": task}] if isinstance(task, str) else list(task)
        started_s = self.clock()
        sid = await self.client.open_session(session_id, cfg.priority) if cfg.use_sessions else None
        schemas = self.tools.openai_schemas()
        steps: list[StepRecord] = []
        failed: set[tuple[str, str]] = set()
        num_replans, is_replan, must_answer = 0, False, False
        answer, stop_reason, error = None, "max_steps", None
        try:
            for step in range(cfg.max_steps):
                rec = StepRecord(step, started_s=self.clock(), is_replan=is_replan)
                choice = "none" if must_answer else cfg.tool_choice_at(step)
                if sid is not None and choice != "none":
                    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
                    rec.expected_wait_s = self.estimator.expected_wait_s(self.tools.names(), named)
                rec.model_started_s = self.clock()
                try:
                    reply = await self.client.chat(
                        messages, tools=schemas or None, tool_choice=choice, session_id=sid,
                        expected_wait_s=rec.expected_wait_s, priority=cfg.priority, stream=cfg.stream,
                        on_text=lambda text, step=step: emit(TextDelta(step, text)), is_retry=is_replan,
                        **cfg.model_params)
                except ModelError as exc:
                    stop_reason, error = "model_error", str(exc)
                    break
                rec.model_finished_s = self.clock()
                rec.model_attempts, rec.num_cached_tokens = reply.num_attempts, reply.num_cached_tokens
                messages.append(reply.message())
                steps.append(rec)
                if not reply.tool_calls:
                    answer, stop_reason = reply.content, "answer"
                    emit(StepDone(rec))
                    break
                if must_answer:  # told to answer and asked for tools anyway: don't run them
                    stop_reason, error = "retry_budget", "tools kept failing and the retry budget is spent"
                    emit(StepDone(rec))
                    break
                results = await self._run_tools(step, rec, reply.tool_calls, failed, emit)
                messages += [{"role": "tool", "tool_call_id": r.call_id, "content": r.content()} for r in results]
                bad = [c for c, r in zip(reply.tool_calls, results) if not r.is_ok]
                failed.update(call_signature(c) for c in bad)
                is_replan = False
                if bad:
                    # NOTE: asking the model again after a failure is a retry like any other: it draws from
                    # the shared budget, and without a token the model must answer with what it has.
                    if num_replans < cfg.max_replans and self.budget.try_acquire_retry(self.clock()):
                        is_replan, num_replans = True, num_replans + 1
                    else:
                        must_answer = True
                emit(StepDone(rec))
        finally:
            if sid is not None and cfg.close_session:
                await asyncio.shield(self.client.close_session(sid))
        result = AgentResult(answer, stop_reason, messages, tuple(steps), sid, num_replans, error)
        self.spans.export(list(steps), started_s, self.clock(), {
            "sessionserve.session_id": sid, "agent.stop_reason": stop_reason, "agent.num_replans": num_replans})
        return result

    async def _run_tools(self, step: int, rec: StepRecord, calls: tuple[ToolCall, ...],
                         failed: set[tuple[str, str]], emit: Callable[[AgentEvent], None]) -> list[ToolResult]:
        plan = [PlannedCall(c.call_id, c.name, c.arguments, is_retry=call_signature(c) in failed) for c in calls]
        rec.tools_started_s = self.clock()
        def on_result(r: ToolResult) -> None:
            emit(ToolDone(step, r))

        try:
            results, rec.critical_path_s = await self.executor.run_plan(plan, on_result)
        except ValueError:
            # Tool-level dependencies that form a cycle within this step (or repeated call ids from the
            # model): run the calls one by one instead, the order the model gave.
            results = []
            for p in plan:
                part, _ = await self.executor.run_plan([p], on_result)
                results += part
            rec.critical_path_s = sum(r.record.duration_s for r in results)
        rec.tools_finished_s = self.clock()
        rec.tool_calls = [r.record for r in results]
        self.estimator.observe_step(rec.tools_s)
        return results
