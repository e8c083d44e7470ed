"""The Hermes format: `<tool_call>\\n{"name": "...", "arguments": {...}}\\n</tool_call>` per call.

The embedded models, Qwen 2.5 / 3 and Hermes write calls so.
`HermesCallStream` reads the output's text deltas and yields `TextDelta`,
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
on model output.
"""

from __future__ import annotations

from collections.abc import Iterable

from sessionserve.server.turn.tool_calls.stream import (
    CALL_HEAD,
    MAX_HEAD_CHARS,
    Event,
    ToolCallStream,
    decode_tool_call,
    is_json_object,
    partial_prefix_len,
    unescape_name,
)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_HELD_TAIL = " \t\r\n}"


class HermesCallStream(ToolCallStream):
    """Reads `<tool_call>` blocks."""

    def __init__(self, tool_names: Iterable[str] | None) -> None:
        super().__init__(tool_names)
        self._mode = "text"  # text | head | args | whole; `_buf`: a partial start tag, or an open block's inside

    def _end(self, events: list[Event]) -> bool:
        # A block left open is dropped, unless it reads as a whole call (the model stopped right after its
        # closing brace).
        if self._mode == "text":
            self._content(self._buf, events)
            return True
        inner = self._buf
        self._mode = "text"
        if self._open is not None:
            args = _strip_call_close(inner)
            if not is_json_object(args):
                return False
            self._send_args(args, events)
            self._close(args, events)
            return True
        decoded = decode_tool_call(inner, self._names)
        if decoded is None:
            return False
        self._whole_call(*decoded, events)
        return True

    def _step(self, events: list[Event]) -> bool:
        if self._mode == "text":
            start = self._buf.find(TOOL_CALL_START)
            if start < 0:
                keep = partial_prefix_len(self._buf, TOOL_CALL_START)
                self._content(self._buf[:len(self._buf) - keep], events)
                self._buf = self._buf[len(self._buf) - keep:]
                return False
            self._content(self._buf[:start], events)
            self._buf = self._buf[start + len(TOOL_CALL_START):]
            self._mode = "head"
            return True
        end = self._buf.find(TOOL_CALL_END)
        if self._mode == "head":
            m = CALL_HEAD.match(self._buf if end < 0 else self._buf[:end])
            if m is not None:
                name = unescape_name(m.group(1))
                if self.is_tool(name):
                    assert name is not None
                    self._start(name, events)
                    self._buf, self._mode = self._buf[m.end():], "args"
                    return True
                self._mode = "whole"
                return True
            if end < 0 and len(self._buf) <= MAX_HEAD_CHARS:
                return False
            self._mode = "whole"
            return True
        if self._mode == "args":
            if end < 0:
                # Hold a partial end tag, and the `}` / whitespace before it (they may close the call object).
                body = self._buf[:len(self._buf) - partial_prefix_len(self._buf, TOOL_CALL_END)]
                self._send_args(body.rstrip(_HELD_TAIL), events)
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


def _strip_call_close(text: str) -> str:
    """The arguments text of a call body: without the call object's closing brace and surrounding space."""
    text = text.rstrip()
    if text.endswith("}"):
        text = text[:-1].rstrip()
    return text
