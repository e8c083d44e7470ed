"""Step routing between models: a large model plans, a small one executes.

Pure: takes an agent step's messages (OpenAI chat format) and returns a
decision; no model, no HTTP, no clock.

Most agent steps do not need the frontier model: reading a tool result and
calling the next tool, filling arguments, formatting. A *plan* step does: the
first step of a task, the step after a user message (a new instruction), the
step after a tool failed (the plan met reality). Everything else, i.e. the
steps that follow successful tool results, is an *execute* step and goes to
the small model. If the small model's answer fails validation (a tool call
to a tool that was not offered, arguments that are not a JSON object or lack
required fields), the step is run again on the large model: an escalation,
counted. A session that escalated recently stays on the large model for a
few steps (`cooldown_steps`), so one confused stretch does not pay twice per
step.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PLAN = "plan"
EXECUTE = "execute"

# A tool result that reports a failure: what shells, Python and HTTP tools print.
_ERROR = re.compile(
    r"(?im)^\s*(error|exception|fatal)\b|traceback \(most recent call last\)|\bexit (code|status) [1-9]"
    r"|\b(command not found|no such file or directory|permission denied)\b|\b[45]\d\d (client|server) error\b")


@dataclass(frozen=True)
class StepView:
    """What routing looks at in an agent step's messages."""

    num_assistant_turns: int  # assistant messages so far: 0 on the first step of a task
    last_role: str  # role of the last message: user | tool | assistant | system
    tool_error: bool  # a tool result after the last assistant message reports a failure


def looks_like_error(text: str) -> bool:
    """Whether a tool result reads as a failure (error line, traceback, non-zero exit, HTTP 4xx/5xx)."""
    return bool(_ERROR.search(text[:4000]))


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def step_view(messages: Sequence[dict[str, Any]]) -> StepView:
    """The routing view of a chat request's messages."""
    num_assistant = sum(1 for m in messages if m.get("role") == "assistant")
    last_role = str(messages[-1].get("role", "user")) if messages else "user"
    error = False
    for m in reversed(messages):
        role = m.get("role")
        if role == "assistant":
            break
        if role == "tool" and looks_like_error(_text(m.get("content"))):
            error = True
    return StepView(num_assistant, last_role, error)


@dataclass(frozen=True)
class ModelRoutePolicy:
    """Chooses the model of one step; `large` and `small` are served model names."""

    large: str
    small: str
    cooldown_steps: int = 2  # steps a session stays on the large model after an escalation

    def classify(self, view: StepView) -> tuple[str, str]:
        """(PLAN | EXECUTE, why)."""
        if view.num_assistant_turns == 0:
            return PLAN, "first step"
        if view.last_role != "tool":
            return PLAN, f"after a {view.last_role} message"
        if view.tool_error:
            return PLAN, "after a tool error"
        return EXECUTE, "after tool results"

    def choose(self, view: StepView, steps_since_escalation: int | None = None) -> tuple[str, str]:
        """(model name, why) for the step."""
        kind, why = self.classify(view)
        if kind == PLAN:
            return self.large, why
        if steps_since_escalation is not None and steps_since_escalation < self.cooldown_steps:
            return self.large, "recent escalation"
        return self.small, why


def validate_tool_calls(calls: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> str | None:
    """Why an answer's tool calls are unusable, or None if they are fine.

    `calls`: OpenAI tool calls ({"function": {"name", "arguments"}}); `tools`:
    the request's tool definitions, OpenAI's ({"type": "function", "function":
    {...}}) or bare functions ({"name", "parameters"}). Checks: the tool was
    offered, the arguments are a JSON object, and the schema's required fields
    are there.
    """
    functions = [t.get("function", t) for t in tools or ()]
    offered = {f.get("name"): f for f in functions}
    for call in calls:
        fn = call.get("function", {})
        name = fn.get("name")
        if name not in offered:
            return f"called {name!r}, which was not offered"
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except json.JSONDecodeError:
            return f"arguments of {name!r} are not JSON"
        if not isinstance(args, dict):
            return f"arguments of {name!r} are not a JSON object"
        required = (offered[name].get("parameters") or {}).get("required") or ()
        missing = [r for r in required if r not in args]
        if missing:
            return f"{name!r} is missing {', '.join(missing)}"
    return None
