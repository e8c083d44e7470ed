"""Which served model runs a turn.

A request names a served model (or one of its aliases, or `default`). With two
or more models, `auto` routes each chat step (`server/model_route.py`): plan
steps to the large model, execution steps (after successful tool results) to
the small one. A small model's answer whose tool calls fail validation is run
again on the large model (an escalation, counted; the session stays on the
large model for a few steps).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from sessionserve.server import protocol as P
from sessionserve.server.app import AUTO_MODEL
from sessionserve.server.model_route import step_view, validate_tool_calls
from sessionserve.server.turn.tool_calls import has_call_markup
from sessionserve.server.turn.types import ToolCall, TurnRequest

if TYPE_CHECKING:
    from sessionserve.server.app import ModelSlot, ServerState

# Sessions whose steps since their last escalation `auto` remembers (least recently routed forgotten first).
MAX_ROUTED_SESSIONS = 10_000


class ModelChooser:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self._since_escalation: OrderedDict[str, int] = OrderedDict()  # routed session key -> steps

    def slot(self, model: str) -> ModelSlot | None:
        """The served model a request names; None for `auto` (chosen per step). 404 for an unknown name."""
        state = self.state
        if model == "default":
            return state.default
        if model == AUTO_MODEL and state.route is not None:
            return None
        found = state.models.get(state.aliases.get(model, model))
        if found is None:
            raise P.OpenAIError(404, f"The model '{model}' does not exist.", "not_found_error", param="model",
                                code="model_not_found")
        return found

    def choose(self, turn: TurnRequest, key: str | None) -> tuple[ModelSlot, str | None]:
        """The model a turn runs on, and why when `auto` chose it (None otherwise)."""
        chosen = self.slot(turn.model)
        if chosen is not None:
            return chosen, None
        route = self.state.route
        assert route is not None
        if turn.messages is None:  # a bare completion has no step to classify: the large model
            return self.state.models[route.large], "completion"
        since = self._since_escalation.get(key) if key else None
        name, why = route.choose(step_view(turn.conversation), since)
        if key is not None and since is not None:
            self._since_escalation[key] = since + 1
            self._since_escalation.move_to_end(key)
        return self.state.models[name], why

    def is_checked(self, turn: TurnRequest, slot: ModelSlot) -> bool:
        """Whether the answer must pass validation before it goes out (the small model of `auto`, with tools)."""
        route = self.state.route
        return route is not None and turn.model == AUTO_MODEL and turn.uses_tools and slot.name == route.small

    def escalate(self, key: str | None) -> ModelSlot:
        """The large model, after the small one's answer failed; the session stays there for a while."""
        route = self.state.route
        assert route is not None
        if key:
            self._since_escalation[key] = 0
            self._since_escalation.move_to_end(key)
            while len(self._since_escalation) > MAX_ROUTED_SESSIONS:
                self._since_escalation.popitem(last=False)
        return self.state.models[route.large]


def answer_problem(text: str, content: str | None, tool_calls: list[ToolCall], tools: list[dict[str, Any]] | None,
                   tool_choice: Any) -> str | None:
    """Why an answer to a request with tools is unusable (a reason for escalation), or None."""
    if not tool_calls:
        if has_call_markup(text):
            return "malformed tool call"
        if tool_choice == "required" or isinstance(tool_choice, dict):
            return "no tool call"
        return None
    calls = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in tool_calls]
    problem = validate_tool_calls(calls, tools)
    return f"invalid tool call: {problem}" if problem else None
