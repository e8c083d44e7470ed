"""The Llama 3 JSON format: the reply is the call, `{"name": "...", "parameters": {...}}`.

Llama 3.1 - 3.3 with JSON tool calling (their chat templates, and vLLM's
`llama3_json`) answer a call with the call object as the whole reply,
optionally after `<|python_tag|>`, several calls separated by `;`.
`LlamaJsonCallStream` reads such a reply as it is generated:

- A reply that starts with `{` (or `<|python_tag|>`) is read as calls. A call
  to a declared tool starts once its name is read and its arguments stream as
  written; an object that is not a call is content as written, once it closes.
- Between calls, `;` and whitespace separate; text that is not a call ends
  the calls and is content (a later `<|python_tag|>` starts calls again).
- A reply that starts with text is content.
- A call cut by the end of the output is not a call, and none of it reaches
  the content; calls completed before it are calls.

The `<|python_tag|>` marker is never content.
"""

from __future__ import annotations

from collections.abc import Iterable

from sessionserve.server.turn.tool_calls.call_object import CallObject
from sessionserve.server.turn.tool_calls.stream import Event, ToolCallStream, partial_prefix_len

PYTHON_TAG = "<|python_tag|>"


class LlamaJsonCallStream(ToolCallStream):
    """Reads a Llama 3 reply: calls as JSON objects, or text."""

    def __init__(self, tool_names: Iterable[str] | None) -> None:
        super().__init__(tool_names)
        self._mode = "start"  # start | text | calls (one is due) | object | after (a call)
        self._object: CallObject | None = None

    def _step(self, events: list[Event]) -> bool:
        buf = self._buf
        if self._mode in ("start", "calls", "after"):
            rest = buf.lstrip()
            if not rest:
                return False
            if rest.startswith(PYTHON_TAG):
                self._buf, self._mode = rest[len(PYTHON_TAG):], "calls"
                return True
            if len(rest) < len(PYTHON_TAG) and PYTHON_TAG.startswith(rest):
                return False  # may be the tag
            if rest[0] == "{":
                self._buf, self._mode, self._object = rest, "object", CallObject()
                return True
            if self._mode == "after" and rest[0] == ";":
                self._buf, self._mode = rest[1:], "calls"
                return True
            self._mode = "text"
            return True
        if self._mode == "text":
            at = buf.find(PYTHON_TAG)
            if at < 0:
                keep = partial_prefix_len(buf, PYTHON_TAG)
                self._content(buf[:len(buf) - keep], events)
                self._buf = buf[len(buf) - keep:]
                return False
            self._content(buf[:at], events)
            self._buf, self._mode = buf[at + len(PYTHON_TAG):], "calls"
            return True
        assert self._object is not None
        ended = self._object.step(self, events)
        if ended is None:
            return False
        if not ended.is_call:
            self._content(ended.text, events)
        self._mode, self._object = "after", None
        return True

    def _end(self, events: list[Event]) -> bool:
        if self._mode == "object":
            assert self._object is not None
            return self._object.end(self, events)
        if self._mode == "calls":  # after `;` or the tag, no call came
            return False
        self._content(self._buf, events)
        return True
