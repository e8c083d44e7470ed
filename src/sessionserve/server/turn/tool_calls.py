"""Model output to text and tool-call events, as it is generated.

The embedded models (and Qwen / Hermes) write a call as
`<tool_call>\\n{"name": "...", "arguments": {...}}\\n</tool_call>`.
`ToolCallStream` reads the output's text deltas and yields `TextDelta`,
`ToolCallStart`, `ToolCallDelta` and `ToolCallEnd` events:

- A call to a declared tool starts as soon as its name has been read, and its
  arguments stream as the model writes them (the trailing `}` of the call
  object and whitespace are held back until it is clear they are not part of
  the arguments). The arguments are returned as the model wrote them: a
  client that sends them back sends the model's own text.
- A block that does not read as a call as it streams (keys in another order,
  arguments as a JSON string) is decided at its end tag: a valid call is sent
  whole; anything else stays in the content as the model wrote it.
- A call cut by the end of the output (a token limit) is not a call: no
  `ToolCallEnd`, and none of its markup reaches the content. Calls completed
  before it are calls.

Content is the text outside call blocks, stripped of leading and trailing
whitespace, streamed so its pieces join to exactly that. Nothing here raises
on model output. `parse_output` runs the same on a finished text, so a stream
however split and the finished reply agree.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable

from sessionserve.server.turn.types import TextDelta, ToolCall, ToolCallDelta, ToolCallEnd, ToolCallStart

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

Event = TextDelta | ToolCallStart | ToolCallDelta | ToolCallEnd

# The opening of a call whose arguments can stream: the name first, then the arguments object.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.){1,256})"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
# Past this many characters without a recognised opening, a block is decided at its end tag.
_MAX_HEAD_CHARS = 512
_HELD_TAIL = " \t\r\n}"


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


def decode_tool_call(inner: str, tool_names: set[str] | None) -> tuple[str, str] | None:
    """(name, arguments as JSON object text) from the text between the tags, or None if it is not a call."""
    try:
        obj = loads_json(inner)
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


def _partial_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _StrippedText:
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
    """Incremental parser of one output. Feed text deltas; `finish()` at the end of the output."""

    def __init__(self, tool_names: Iterable[str] | None) -> None:
        self._names = set(tool_names) if tool_names is not None else None
        self._buf = ""  # text not yet decided: a partial start tag, or the inside of an open block
        self._mode = "text"  # text | head | args | whole
        self._sent_args = 0  # characters of the open call's arguments already sent
        self._open: ToolCallStart | None = None
        self._text = _StrippedText()
        self.calls: list[ToolCall] = []  # complete calls so far
        self.is_cut = False  # the output ended inside a call block that was not a call

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
        """The output ended: flush held-back text; a block left open is dropped, unless it reads as a
        whole call (the model stopped right after its closing brace)."""
        events: list[Event] = []
        if self._mode == "text":
            self._content(self._buf, events)
        else:
            inner = self._buf
            if self._mode == "args":
                assert self._open is not None
                args = _strip_call_close(inner)
                if _is_json_object(args):
                    self._send_args(args, events)
                    self._close(args, events)
            else:
                decoded = decode_tool_call(inner, self._names)
                if decoded is not None:
                    self._whole_call(*decoded, events)
        self.is_cut = self._mode != "text" and not (events and isinstance(events[-1], ToolCallEnd))
        self._buf, self._mode = "", "text"
        return events

    # -- states --------------------------------------------------------------------------------

    def _step(self, events: list[Event]) -> bool:
        """Advance as far as the buffer allows; True if the state changed (run again)."""
        if self._mode == "text":
            start = self._buf.find(TOOL_CALL_START)
            if start < 0:
                keep = _partial_prefix_len(self._buf, TOOL_CALL_START)
                self._content(self._buf[:len(self._buf) - keep], events)
                self._buf = self._buf[len(self._buf) - keep:]
                return False
            self._content(self._buf[:start], events)
            self._buf = self._buf[start + len(TOOL_CALL_START):]
            self._mode = "head"
            return True
        end = self._buf.find(TOOL_CALL_END)
        if self._mode == "head":
            m = _HEAD.match(self._buf if end < 0 else self._buf[:end])
            if m is not None:
                name = _unescape(m.group(1))
                if name is not None and (self._names is None or name in self._names):
                    self._open = ToolCallStart(len(self.calls), new_call_id(), name)
                    events.append(self._open)
                    self._buf, self._mode, self._sent_args = self._buf[m.end():], "args", 0
                    return True
                self._mode = "whole"
                return True
            if end < 0 and len(self._buf) <= _MAX_HEAD_CHARS:
                return False
            self._mode = "whole"
            return True
        if self._mode == "args":
            if end < 0:
                hold = max(len(self._buf) - len(self._buf.rstrip(_HELD_TAIL)),
                           _partial_prefix_len(self._buf, TOOL_CALL_END))
                self._send_args(self._buf[:len(self._buf) - hold], events)
                return False
            args = _strip_call_close(self._buf[:end])
            self._send_args(args, events)
            self._close(args, events)
            self._buf, self._mode = self._buf[end + len(TOOL_CALL_END):], "text"
            return True
        # whole: decided at the end tag
        if end < 0:
            return False
        inner = self._buf[:end]
        self._buf, self._mode = self._buf[end + len(TOOL_CALL_END):], "text"
        decoded = decode_tool_call(inner, self._names)
        if decoded is None:
            self._content(TOOL_CALL_START + inner + TOOL_CALL_END, events)
        else:
            self._whole_call(*decoded, events)
        return True

    # -- emitting ------------------------------------------------------------------------------

    def _content(self, text: str, events: list[Event]) -> None:
        out = self._text.push(text) if text else ""
        if not out:
            return
        if events and isinstance(events[-1], TextDelta):
            events[-1] = TextDelta(events[-1].text + out)  # one piece per feed rather than one per part
        else:
            events.append(TextDelta(out))

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
        start = ToolCallStart(len(self.calls), new_call_id(), name)
        self._open, self._sent_args = start, 0
        events.append(start)
        self._send_args(arguments, events)
        self._close(arguments, events)


def _strip_call_close(text: str) -> str:
    """The arguments text of a call body: without the call object's closing brace and surrounding space."""
    text = text.rstrip()
    if text.endswith("}"):
        text = text[:-1].rstrip()
    return text


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(loads_json(text), dict)
    except ValueError:
        return False


def _unescape(raw: str) -> str | None:
    try:
        value = json.loads(f'"{raw}"')
    except ValueError:
        return None
    return value if isinstance(value, str) and value else None


def parse_output(text: str, tool_names: Iterable[str] | None) -> tuple[str | None, list[ToolCall], bool]:
    """(content, complete calls, whether a call was cut) of a finished output: the stream's result."""
    stream = ToolCallStream(tool_names)
    stream.feed(text)
    stream.finish()
    return stream.content, stream.calls, stream.is_cut
