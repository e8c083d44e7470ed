"""The agent-session trace schema: sessions of LLM steps separated by tool waits.

A session is a sequence of steps. An LLM step sends `new_input_tokens` (what
the session did not have before: the task, tool results, a user message) and
generates `output_tokens`; then it waits for its tool calls. Calls in the same
`group` run concurrently; groups run one after another, so the wait after a
step is the sum over groups of the longest call in each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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

    @property
    def num_tokens(self) -> int:
        return sum(s.new_input_tokens + s.output_tokens for s in self.steps)
