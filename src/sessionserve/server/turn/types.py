"""The protocol-neutral turn: what a request asks for, what the pipeline yields back.

Messages are the chat template's shape (`role` system | user | assistant |
tool, `content` a string or text parts, assistant `tool_calls` as
`{"id", "type": "function", "function": {"name", "arguments"}}`, tool
`tool_call_id`); tools are `{"type": "function", "function": {"name",
"description", "parameters"}}`. Every adapter maps its protocol into these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from sessionserve.llm_engine import RequestOutput
    from sessionserve.types.guided import GuidedDecoding

Protocol = Literal["chat", "text", "responses", "messages"]
FinishReason = Literal["stop", "length", "tool_calls", "abort"]


@dataclass(frozen=True, slots=True)
class SessionPoint:
    """A place in a session's history: what a stored response, or a session's latest turn, left behind.

    `end` tokens of session `key` held that history after turn number `num_turns`; `tokens_digest` is a
    digest of those tokens (to tell whether a session that moved on still starts with them);
    `stop_text` is the text of the special token the chat template closes the reply with, and `stopped`
    whether the reply generated it (it ended on it) or was cut before (a token limit). None: the tokens
    are not the reply as returned (a tool call cut off): the next turn re-renders.
    """

    key: str
    end: int
    num_turns: int
    tokens_digest: str
    stop_text: str | None
    stopped: bool = True


@dataclass(frozen=True, slots=True)
class Continuation:
    """A session's point after a turn, and the digest of the conversation it holds there
    (continuation.conversation_digests: the messages and tools that made the prompt, then the reply)."""

    point: SessionPoint
    digest: str


@dataclass(frozen=True, slots=True)
class SessionHint:
    """Who the session is, from what the client sent (see identity.py for the order)."""

    explicit: str | None = None  # X-Session-ID / body session_id: the client names its session
    group: str | None = None  # prompt_cache_key, session-id, X-Claude-Code-Session-Id, metadata.user_id...
    source: str | None = None  # which field gave the id (for metrics and the route header)
    previous: Continuation | None = None  # the stored response a Responses request continues


@dataclass
class TurnRequest:
    """One generation request, protocol-neutral."""

    protocol: Protocol
    model: str
    messages: list[dict[str, Any]] | None = None  # chat-shaped; None for a raw completion
    prompt: str | list[int] | None = None  # a raw completion's prompt
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # auto | none | required | {"name": ...}
    parallel_tool_calls: bool = True
    response_format: GuidedDecoding | None = None  # the final answer's shape (JSON object / schema)
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields, max_tokens excepted
    max_tokens: int | None = None  # None: until the context is full
    clamp_max_tokens: bool = False  # a cap past the context is cut to it (else a 400, as OpenAI's chat does)
    stream: bool = False
    session: SessionHint = field(default_factory=SessionHint)
    # Messages a stored response holds before `messages` (previous_response_id): rendered as the
    # conversation's start, never sent to the engine again when the session still holds them.
    history: list[dict[str, Any]] = field(default_factory=list)
    priority: str | None = None
    expected_wait_s: float | None = None
    logprobs: int | None = None  # top alternatives per token; 0: the sampled token's only; None: off

    @property
    def tool_names(self) -> set[str] | None:
        return {t["function"]["name"] for t in self.tools} if self.tools else None

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def conversation(self) -> list[dict[str, Any]]:
        return [*self.history, *(self.messages or ())]


@dataclass(frozen=True, slots=True)
class ToolCall:
    call_id: str
    name: str
    arguments: str  # a JSON object as text, as the model wrote it when it parsed


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int
    call_id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int
    arguments: str  # the next piece of the arguments text


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    index: int
    call: ToolCall


@dataclass(frozen=True, slots=True)
class StepOutput:
    """The engine's output for one step, before the events derived from it (token ids, logprobs)."""

    output: RequestOutput


@dataclass
class TurnResult:
    """The finished turn: always the last thing a turn yields."""

    output: RequestOutput
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: FinishReason
    model: str  # served name of the model that ran it
    session_id: str | None  # the client-visible session id the turn ran in, if any
    session_key: str | None
    route: str | None = None  # why `auto` chose the model
    escalated_from: str | None = None
    continuation: Continuation | None = None  # where the session stands after this turn
    cut_tool_call: bool = False  # the output ended inside a tool call (not returned as a call)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.output.prompt_token_ids)

    @property
    def num_cached_tokens(self) -> int:
        return self.output.num_cached_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output.token_ids)


TurnEvent = TextDelta | ToolCallStart | ToolCallDelta | ToolCallEnd | StepOutput | TurnResult
