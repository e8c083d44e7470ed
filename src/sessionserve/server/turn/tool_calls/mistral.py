"""The Mistral formats: calls after the `[TOOL_CALLS]` marker, in either of Mistral's two forms.

- `[TOOL_CALLS] [{"name": "...", "arguments": {...}}, ...]`: a JSON list of
  call objects (Mistral tokenizers before v11: 7B v0.3, Nemo, Small 3). The
  template writes past calls with an `"id"` key after the arguments, read past.
- `[TOOL_CALLS]name[ARGS]{...}`, the marker before each call (tokenizer v11
  and later: Small 3.2, Devstral, Magistral); `[CALL_ID]id` may sit between
  the name and `[ARGS]`, and a decoder that drops `[ARGS]` leaves `name{...}`.

`MistralCallStream` reads both, whichever follows the marker. A call to a
declared tool starts once its name is read and its arguments stream as
written; a list element that is not a call is content as written, as is a
`name[ARGS]{...}` call to an unknown tool (with its markers). Text outside
the markup is content. A call cut by the end of the output is not a call, and
none of its markup reaches the content. Call ids are 9 letters and digits,
the only ids Mistral's templates accept.
"""

from __future__ import annotations

import re
import secrets
import string
from collections.abc import Iterable

from sessionserve.server.turn.tool_calls.call_object import CallObject
from sessionserve.server.turn.tool_calls.stream import Event, ToolCallStream, partial_prefix_len

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_ID_CHARS = string.ascii_letters + string.digits
_MAX_NAME_CHARS = 256
_NAME = re.compile(r"[\w.\-]*")


def new_mistral_call_id() -> str:
    """9 random letters and digits: Mistral's templates reject other tool-call ids."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


class MistralCallStream(ToolCallStream):
    """Reads `[TOOL_CALLS]` markup of either form, and text."""

    def __init__(self, tool_names: Iterable[str] | None) -> None:
        super().__init__(tool_names)
        # text | marker (after [TOOL_CALLS]) | list | element | name | call_id | args_start | args
        self._mode = "text"
        self._object: CallObject | None = None
        self._name = ""  # the name of the `name[ARGS]{...}` call being read
        self._markup = ""  # that call's markup as written, for the content if it is not a call

    def _new_call_id(self) -> str:
        return new_mistral_call_id()

    def _step(self, events: list[Event]) -> bool:
        buf, mode = self._buf, self._mode
        if mode == "text":
            at = buf.find(TOOL_CALLS)
            if at < 0:
                keep = partial_prefix_len(buf, TOOL_CALLS)
                self._content(buf[:len(buf) - keep], events)
                self._buf = buf[len(buf) - keep:]
                return False
            self._content(buf[:at], events)
            self._buf, self._mode = buf[at + len(TOOL_CALLS):], "marker"
            return True
        if mode == "marker":
            rest = buf.lstrip()
            if not rest:
                return False
            if rest[0] == "[":  # no name starts with a bracket
                self._buf, self._mode = rest[1:], "list"
            else:
                self._buf, self._mode, self._markup = rest, "name", TOOL_CALLS + buf[:len(buf) - len(rest)]
            return True
        if mode == "list":
            rest = buf.lstrip(" \t\r\n,")
            if not rest:
                self._buf = ""
                return False
            if rest[0] == "]":
                self._buf, self._mode = rest[1:], "text"
            elif rest[0] == "{":
                self._buf, self._mode, self._object = rest, "element", CallObject()
            else:  # not a list of calls after all: the rest is text
                self._buf, self._mode = rest, "text"
            return True
        if mode == "name":
            return self._read_name(events)
        if mode == "call_id":
            at = buf.find(ARGS)
            if at < 0:
                return False
            self._markup += buf[:at + len(ARGS)]
            self._buf, self._mode = buf[at + len(ARGS):], "args_start"
            return True
        if mode == "args_start":
            rest = buf.lstrip()
            if not rest:
                return False
            if rest[0] != "{":  # no arguments: the markup was text
                self._content(self._markup, events)
                self._mode = "text"
                return True
            is_call = self.is_tool(self._name)
            if is_call:
                self._start(self._name, events)
            self._buf, self._mode, self._object = rest, "args", CallObject.arguments_of(is_open=is_call)
            return True
        assert self._object is not None  # element | args
        ended = self._object.step(self, events)
        if ended is None:
            return False
        if not ended.is_call:
            self._content((self._markup if mode == "args" else "") + ended.text, events)
        self._mode, self._object = "list" if mode == "element" else "text", None
        return True

    def _read_name(self, events: list[Event]) -> bool:
        """`name` up to `[ARGS]`, `[CALL_ID]` or the arguments' `{`."""
        buf = self._buf
        ends = [(at, tag) for tag in (ARGS, CALL_ID, "{") if (at := buf.find(tag)) >= 0]
        at, tag = min(ends) if ends else (len(buf) - max(partial_prefix_len(buf, ARGS),
                                                         partial_prefix_len(buf, CALL_ID)), None)
        if _NAME.fullmatch(buf[:at]) is None or at > _MAX_NAME_CHARS:  # not a name: the marker was text
            self._content(self._markup, events)
            self._mode = "text"
            return True
        if tag is None:
            return False
        self._name = buf[:at]
        if tag == "{":
            self._markup += buf[:at]
            self._buf, self._mode = buf[at:], "args_start"
        else:
            self._markup += buf[:at + len(tag)]
            self._buf, self._mode = buf[at + len(tag):], "call_id" if tag == CALL_ID else "args_start"
        return True

    def _end(self, events: list[Event]) -> bool:
        if self._mode == "text":
            self._content(self._buf, events)
            return True
        if self._mode in ("element", "args"):
            assert self._object is not None
            return self._object.end(self, events)
        return False
