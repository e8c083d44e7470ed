"""What every tool-call format's parser shares: the events it yields, the content, calls and JSON reading.

`ToolCallStream` holds the parser's output side (content streamed stripped,
calls numbered from 0 with fresh ids, arguments sent in pieces); a format
reads its own markup in `_step` / `_end`.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable

from sessionserve.server.turn.types import TextDelta, ToolCall, ToolCallDelta, ToolCallEnd, ToolCallStart

Event = TextDelta | ToolCallStart | ToolCallDelta | ToolCallEnd

# The opening of a call whose arguments can stream: the name first, then the arguments object.
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.){1,256})"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
# Past this many characters without a recognised opening, a call is decided when it ends.
MAX_HEAD_CHARS = 512


def new_call_id() -> str:
    """`call_` + 24 random URL-safe characters, like OpenAI's ids."""
    return "call_" + secrets.token_urlsafe(18)


def _reject_constant(name: str) -> None:
    # NaN / Infinity parse in Python but are not JSON: clients could not read them back.
    raise ValueError(f"non-JSON constant {name}")


def loads_json(text: str) -> object:
    """JSON as clients read it (no NaN / Infinity); ValueError when it is not."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def decode_tool_call(text: str, tool_names: set[str] | None) -> tuple[str, str] | None:
    """(name, arguments as JSON object text) of a call object's text, or None if it is not a call."""
    try:
        obj = loads_json(text)
    except ValueError:
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
            args = loads_json(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


def is_json_object(text: str) -> bool:
    try:
        return isinstance(loads_json(text), dict)
    except ValueError:
        return False


def unescape_name(raw: str) -> str | None:
    """A JSON string's body (between its quotes) as text; None if it is not one, or empty."""
    try:
        value = json.loads(f'"{raw}"')
    except ValueError:
        return None
    return value if isinstance(value, str) and value else None


def partial_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class StrippedText:
    """Streams text so the pieces join to the whole text `.strip()`ed."""

    def __init__(self) -> None:
        self._started = False
        self._pending_ws = ""
        self.text = ""

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body):]
        self.text += body
        return body


class ToolCallStream:
    """Incremental parser of one output. Feed text deltas; `finish()` at the end of the output.

    A format subclass reads its markup from `_buf` in `_step` and `_end`, and
    emits through `_content`, `_start`, `_send_args`, `_close` and `_whole_call`.
    """

    def __init__(self, tool_names: Iterable[str] | None) -> None:
        self._names = set(tool_names) if tool_names is not None else None
        self._buf = ""  # text read but not yet decided
        self._open: ToolCallStart | None = None  # the call whose arguments are streaming
        self._sent_args = 0  # characters of the open call's arguments already sent
        self._text = StrippedText()
        self.calls: list[ToolCall] = []  # complete calls so far
        self.is_cut = False  # the output ended inside call markup (set by finish)

    @property
    def content(self) -> str | None:
        return self._text.text or None

    def feed(self, delta: str) -> list[Event]:
        events: list[Event] = []
        self._buf += delta
        while self._step(events):
            pass
        return events

    def finish(self) -> list[Event]:
        """The output ended: flush held-back text; a call left open is dropped unless it is whole."""
        events: list[Event] = []
        self.is_cut = not self._end(events)
        self._buf = ""
        return events

    def _step(self, events: list[Event]) -> bool:
        """Advance as far as the buffer allows; True if the state changed (run again)."""
        raise NotImplementedError

    def _end(self, events: list[Event]) -> bool:
        """Decide what is left at the end of the output; False if it ended inside a call (cut)."""
        raise NotImplementedError

    # -- emitting ------------------------------------------------------------------------------

    def is_tool(self, name: str | None) -> bool:
        return bool(name) and (self._names is None or name in self._names)

    def _new_call_id(self) -> str:
        return new_call_id()

    def _content(self, text: str, events: list[Event]) -> None:
        out = self._text.push(text) if text else ""
        if not out:
            return
        if events and isinstance(events[-1], TextDelta):
            events[-1] = TextDelta(events[-1].text + out)  # one piece per feed rather than one per part
        else:
            events.append(TextDelta(out))

    def _start(self, name: str, events: list[Event]) -> None:
        self._open = ToolCallStart(len(self.calls), self._new_call_id(), name)
        self._sent_args = 0
        events.append(self._open)

    def _send_args(self, args: str, events: list[Event]) -> None:
        assert self._open is not None
        if len(args) > self._sent_args:
            events.append(ToolCallDelta(self._open.index, args[self._sent_args:]))
            self._sent_args = len(args)

    def _close(self, args: str, events: list[Event]) -> None:
        assert self._open is not None
        call = ToolCall(self._open.call_id, self._open.name, args)
        self.calls.append(call)
        events.append(ToolCallEnd(self._open.index, call))
        self._open = None

    def _whole_call(self, name: str, arguments: str, events: list[Event]) -> None:
        self._start(name, events)
        self._send_args(arguments, events)
        self._close(arguments, events)


def parse_with(stream: ToolCallStream, text: str) -> tuple[str | None, list[ToolCall], bool]:
    """(content, complete calls, whether a call was cut) of a finished output read by `stream`."""
    stream.feed(text)
    stream.finish()
    return stream.content, stream.calls, stream.is_cut
