"""The agent-session trace schema: sessions of LLM steps separated by tool waits.

A session is a sequence of steps. An LLM step sends `new_input_tokens` (what
the session did not have before: the task, tool results, a user message) and
generates `output_tokens`; then it waits for its tool calls. Calls in the same
`group` run concurrently; groups run one after another, so the wait after a
step is the sum over groups of the longest call in each.

Shared-prefix structure (optional, where a trace knows it):
- `Step.prefix_block_ids`: the leading part of a step's new input is made of
  blocks of `prefix_block_tokens` tokens; equal block ids (within one trace,
  across its sessions) mean identical token contents, so a prompt builder
  turns shared prefixes in the trace into shared prefixes in the prompts
  (a system prompt, tool definitions, a chat branch).
- `Step.context_kept_tokens`: None means the step's prompt extends the whole
  session context; a number means the client cut the context to its first
  that many tokens first (compaction, restart), and the rest is recomputed.

Sub-agents (`AgentSession.subagents`, optional): sessions a session starts
after one of its steps (a coding agent's Task tool); see `SubAgent`.

`TraceSet` is what a loader returns: the sessions plus the scale factors
applied and a `provenance` list saying where each part came from and what was
synthesised (reports print it). On disk: JSONL, see `trace_io.py`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    duration_s: float
    group: int = 0


@dataclass(frozen=True, slots=True)
class Step:
    new_input_tokens: int
    output_tokens: int
    tool_calls: tuple[ToolCall, ...] = ()
    # "tool": the wait after this step is tool time; "human": a user's think time; "end": last step.
    wait_kind: str = "tool"
    # Shared-prefix structure of the new input (see the module docstring); () = all private tokens.
    prefix_block_ids: tuple[int, ...] = ()
    prefix_block_tokens: int = 0  # tokens per prefix block; the last block may be cut short
    context_kept_tokens: int | None = None  # None: extend the whole context; N: cut it to N tokens first

    @property
    def wait_s(self) -> float:
        groups: dict[int, float] = {}
        for call in self.tool_calls:
            groups[call.group] = max(groups.get(call.group, 0.0), call.duration_s)
        return sum(groups.values())

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(sorted({c.name for c in self.tool_calls}))


@dataclass(frozen=True)
class AgentSession:
    session_id: str
    steps: tuple[Step, ...]
    arrival_s: float | None = None  # None: the replay driver sets arrivals
    source: str = ""
    meta: dict = field(default_factory=dict)
    priority: str = "interactive"  # "interactive" | "batch": the session's scheduling class
    subagents: tuple[SubAgent, ...] = ()  # sessions this one starts (see `SubAgent`)

    @property
    def num_tokens(self) -> int:
        return sum(s.new_input_tokens + s.output_tokens for s in self.steps)

    def subagents_after(self, step_index: int) -> tuple[SubAgent, ...]:
        return tuple(a for a in self.subagents if a.after_step == step_index)

    def expected_wait_s(self, step_index: int) -> float:
        """How long the session waits after `step_index` in the trace: its blocking sub-agents, then its tools."""
        blocking = [a.duration_s for a in self.subagents_after(step_index) if a.blocking]
        return max(blocking, default=0.0) + self.steps[step_index].wait_s


@dataclass(frozen=True)
class SubAgent:
    """A session that another one starts when its step `after_step` ends (a coding agent's Task tool).

    Sub-agents started after the same step run concurrently. `blocking`: the
    parent's next step waits until the sub-agent ends, then waits the step's
    own tool calls (the rest of its wait in the trace); otherwise the sub-agent
    runs in the background. A sub-agent's first prompt shares its leading
    blocks with its siblings' where the trace says so (`prefix_block_ids`).
    `duration_s`: its span in the trace, from its first call to the end of its
    last (a wait hint; the replay measures its own).
    """

    after_step: int
    session: AgentSession
    duration_s: float
    blocking: bool = True


@dataclass(frozen=True)
class TraceSet:
    """Sessions loaded from one trace, with the factors applied and where every part came from.

    token_scale / time_scale: token counts / durations were divided by these
    (ratios kept). provenance: one sentence per fact about origin or synthesis,
    with citations; reports print it verbatim.
    """

    name: str
    sessions: tuple[AgentSession, ...]
    token_scale: float = 1.0
    time_scale: float = 1.0
    provenance: tuple[str, ...] = ()

    def head(self, num_sessions: int) -> TraceSet:
        """The first `num_sessions` sessions, same factors and provenance."""
        return TraceSet(self.name, self.sessions[:num_sessions], self.token_scale, self.time_scale, self.provenance)

    def scaled(self, token_scale: float = 1.0, time_scale: float = 1.0) -> TraceSet:
        """Divide token counts and durations further by these factors (the recorded factors multiply)."""
        if token_scale == 1.0 and time_scale == 1.0:
            return self
        return TraceSet(self.name, tuple(scale_session(s, token_scale, time_scale) for s in self.sessions),
                        self.token_scale * token_scale, self.time_scale * time_scale, self.provenance)

    def truncated(self, max_steps: int) -> TraceSet:
        """Every session cut to its first `max_steps` steps (the last one becomes an "end" step)."""
        return TraceSet(self.name, tuple(truncate_session(s, max_steps) for s in self.sessions), self.token_scale,
                        self.time_scale, self.provenance)


def scale_session(session: AgentSession, token_scale: float, time_scale: float) -> AgentSession:
    """`session` with token counts divided by token_scale (at least 1) and times by time_scale."""
    def tok(n: int) -> int:
        return max(1, round(n / token_scale))

    steps = tuple(replace(
        s, new_input_tokens=tok(s.new_input_tokens), output_tokens=tok(s.output_tokens),
        tool_calls=tuple(replace(c, duration_s=c.duration_s / time_scale) for c in s.tool_calls),
        prefix_block_tokens=tok(s.prefix_block_tokens) if s.prefix_block_ids else 0,
        context_kept_tokens=None if s.context_kept_tokens is None else round(s.context_kept_tokens / token_scale))
        for s in session.steps)
    arrival = None if session.arrival_s is None else session.arrival_s / time_scale
    subagents = tuple(replace(a, session=scale_session(a.session, token_scale, time_scale),
                              duration_s=a.duration_s / time_scale) for a in session.subagents)
    return replace(session, steps=steps, arrival_s=arrival, subagents=subagents)


def truncate_session(session: AgentSession, max_steps: int) -> AgentSession:
    """The first `max_steps` steps (the last becomes an "end" step); sub-agents started by a later step, or
    by the new last step (nothing would wait for them), are dropped."""
    if len(session.steps) <= max_steps:
        return session
    steps = session.steps[:max_steps]
    steps = steps[:-1] + (replace(steps[-1], tool_calls=(), wait_kind="end"),)
    subagents = tuple(a for a in session.subagents if a.after_step < max_steps - 1)
    return replace(session, steps=steps, subagents=subagents)


def with_batch_fraction(sessions: Sequence[AgentSession], fraction: float, seed: int) -> tuple[AgentSession, ...]:
    """The sessions with a `fraction` of them (chosen by `seed`, whatever their order) marked `batch`.

    Real traces carry no priority class; a mixed workload is the trace with
    some sessions declared background, as an operator would run them.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"batch fraction must be in [0, 1], got {fraction}")
    ranked = sorted(sessions, key=lambda s: hashlib.blake2b(f"{seed}:{s.session_id}".encode(),
                                                            digest_size=8).digest())
    batch = {id(s) for s in ranked[:round(fraction * len(sessions))]}
    return tuple(replace(s, priority="batch" if id(s) in batch else "interactive") for s in sessions)
