"""What a model call returns (text, tool calls, usage), built from a JSON reply or from streamed chunks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """A tool call the model asked for; `arguments` is the JSON text as the model wrote it."""

    call_id: str
    name: str
    arguments: str

    def message(self) -> dict[str, Any]:
        return {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ModelReply:
    """One chat completion, after any HTTP retries."""

    content: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str | None
    usage: dict[str, Any] = field(default_factory=dict)
    num_attempts: int = 1

    @property
    def num_cached_tokens(self) -> int:
        details = self.usage.get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)

    def message(self) -> dict[str, Any]:
        """The assistant message to append to the conversation."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = [tc.message() for tc in self.tool_calls]
        return msg


def reply_from_json(body: dict[str, Any], num_attempts: int = 1) -> ModelReply:
    """A non-streamed chat completion to a `ModelReply`."""
    choice = (body.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    calls = tuple(ToolCall(tc.get("id") or f"call_{i}", tc["function"]["name"], tc["function"].get("arguments") or "")
                  for i, tc in enumerate(msg.get("tool_calls") or []))
    return ModelReply(msg.get("content"), calls, choice.get("finish_reason"), body.get("usage") or {}, num_attempts)


class StreamAssembler:
    """Accumulates chat.completion.chunk objects: content deltas, tool-call fragments by index, usage."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] = {}

    def feed(self, chunk: dict[str, Any]) -> str:
        """Add one chunk; returns its text delta ('' when none)."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        text = ""
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                text += delta["content"]
            for tc in delta.get("tool_calls") or []:
                slot = self.calls.setdefault(tc.get("index", len(self.calls)), {"id": None, "name": "", "args": ""})
                slot["id"] = tc.get("id") or slot["id"]
                fn = tc.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["args"] += fn.get("arguments") or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if text:
            self.content.append(text)
        return text

    def reply(self, num_attempts: int = 1) -> ModelReply:
        calls = tuple(ToolCall(s["id"] or f"call_{i}", s["name"], s["args"]) for i, s in sorted(self.calls.items()))
        content = "".join(self.content) if self.content or not calls else None
        return ModelReply(content, calls, self.finish_reason, self.usage, num_attempts)
