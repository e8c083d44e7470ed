"""Tool calls in model output, Qwen/Hermes format: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

`parse_tool_calls` splits a finished output into content and OpenAI tool
calls; `StreamingToolParser` does the same on text deltas and yields OpenAI
streaming deltas. Both scan the same way (first `<tool_call>`, then the first
`</tool_call>` after it), so a stream, however it is split, yields the same
content and calls as the finished text. A block that is not a valid call
(bad JSON, no name, a tool that was not declared, no end tag) is not a call:
it stays in the content as the model wrote it. Nothing here raises on model
output.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

Event = dict[str, Any]  # a chat chunk delta: {"content": str} or {"tool_calls": [delta]}


def new_tool_call_id() -> str:
    """`call_` + 24 random URL-safe characters, like OpenAI's ids."""
    return "call_" + secrets.token_urlsafe(18)


def _reject_constant(name: str) -> Any:
    # NaN / Infinity parse in Python but are not JSON: clients could not read them back.
    raise ValueError(f"non-JSON constant {name}")


def decode_tool_call(inner: str, tool_names: set[str] | None) -> tuple[str, str] | None:
    """(name, arguments as a JSON object string) from the text between the tags, or None if invalid."""
    try:
        obj = json.loads(inner, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name or (tool_names is not None and name not in tool_names):
        return None
    # Llama-style models say "parameters"; a call with neither takes no arguments.
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


def _tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": new_tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(text: str, tool_names: set[str] | None) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a finished output.

    content is the text outside valid call blocks, stripped, None if empty.
    `tool_names` None accepts any name; a set accepts only those.
    """
    parts: list[str] = []
    calls: list[dict[str, Any]] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_START, pos)
        if start < 0:
            parts.append(text[pos:])
            break
        parts.append(text[pos:start])
        end = text.find(TOOL_CALL_END, start + len(TOOL_CALL_START))
        if end < 0:
            parts.append(text[start:])  # unterminated: plain text
            break
        decoded = decode_tool_call(text[start + len(TOOL_CALL_START):end], tool_names)
        if decoded is not None:
            calls.append(_tool_call(*decoded))
        else:
            parts.append(text[start:end + len(TOOL_CALL_END)])
        pos = end + len(TOOL_CALL_END)
    content = "".join(parts).strip()
    return content or None, calls


def _partial_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _StrippedText:
    """Streams text so the pieces join to the whole text `.strip()`ed.

    Leading whitespace is dropped; trailing whitespace is held until more
    text follows it (and dropped if none does), which is what strip() does to
    the finished content.
    """

    def __init__(self) -> None:
        self._started = False
        self._pending_ws = ""

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body):]
        return body


class StreamingToolParser:
    """Incremental `parse_tool_calls`: feed text deltas, get chat chunk deltas.

    Events are `{"content": str}` for text outside call blocks, and for each
    valid call `{"tool_calls": [{"index", "id", "type", "function": {"name",
    "arguments": ""}}]}` followed by `{"tool_calls": [{"index", "function":
    {"arguments": ...}}]}`. A call's arguments are sent once its block has
    ended: only then is it known to be a call and not text (a block cut by
    max_tokens must come out as content, as in the non-streaming reply).
    """

    def __init__(self, tool_names: Iterable[str] | None) -> None:
        self._names = set(tool_names) if tool_names is not None else None
        self._buf = ""  # text not yet emitted: a partial start tag, or the inside of an open block
        self._in_call = False
        self._end_scan_from = 0  # where in _buf the end tag may start (skip rescanning)
        self._text = _StrippedText()
        self.tool_calls: list[dict[str, Any]] = []  # complete calls so far, as parse_tool_calls returns them

    def feed(self, delta: str) -> list[Event]:
        events: list[Event] = []
        self._buf += delta
        while True:
            if not self._in_call:
                start = self._buf.find(TOOL_CALL_START)
                if start < 0:
                    # Hold back what may be the beginning of a start tag, like a stop-string holdback.
                    keep = _partial_prefix_len(self._buf, TOOL_CALL_START)
                    self._content(self._buf[:len(self._buf) - keep], events)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return events
                self._content(self._buf[:start], events)
                self._buf = self._buf[start + len(TOOL_CALL_START):]
                self._in_call, self._end_scan_from = True, 0
            else:
                end = self._buf.find(TOOL_CALL_END, self._end_scan_from)
                if end < 0:
                    self._end_scan_from = max(0, len(self._buf) - len(TOOL_CALL_END) + 1)
                    return events
                inner = self._buf[:end]
                self._buf = self._buf[end + len(TOOL_CALL_END):]
                self._in_call = False
                decoded = decode_tool_call(inner, self._names)
                if decoded is None:
                    self._content(TOOL_CALL_START + inner + TOOL_CALL_END, events)
                else:
                    self._call(*decoded, events)

    def finish(self) -> list[Event]:
        """Flush at the end of the output: held-back text, or an unterminated block, as content."""
        events: list[Event] = []
        rest = (TOOL_CALL_START + self._buf) if self._in_call else self._buf
        self._buf, self._in_call = "", False
        self._content(rest, events)
        return events

    def _content(self, text: str, events: list[Event]) -> None:
        out = self._text.push(text) if text else ""
        if not out:
            return
        if events and "content" in events[-1]:
            events[-1]["content"] += out  # one chunk per feed rather than one per piece
        else:
            events.append({"content": out})

    def _call(self, name: str, arguments: str, events: list[Event]) -> None:
        call = _tool_call(name, arguments)
        index = len(self.tool_calls)
        self.tool_calls.append(call)
        events.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                       "function": {"name": name, "arguments": ""}}]})
        events.append({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]})
