"""One call object `{"name": ..., "arguments" | "parameters": {...}}` read as it streams.

For the formats that write calls as bare JSON, with no end tag to wait for
(Llama 3, Mistral): `JsonEnd` finds where a JSON object closes as its text
arrives, and `CallObject` reads a call from a stream's buffer with it.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from sessionserve.server.turn.tool_calls.stream import (
    CALL_HEAD,
    MAX_HEAD_CHARS,
    Event,
    ToolCallStream,
    decode_tool_call,
    unescape_name,
)

_IN_STRING = re.compile(r'["\\]')
_STRUCTURE = re.compile(r'[{}\[\]"]')


class JsonEnd:
    """Finds where a JSON object or array ends, given a growing text that starts with its opening bracket.

    `depth` > 0 starts inside that many open brackets (the rest of an object whose start was read).
    Only brackets and strings are tracked: whether the text is valid JSON is for `loads_json` to say.
    """

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth
        self.num_scanned = 0  # characters of the text already read
        self._in_string = False

    def scan(self, text: str) -> int | None:
        """Read `text` past what was read before; the index just past the closing bracket, or None."""
        i, n = self.num_scanned, len(text)
        while i < n:
            if self._in_string:
                m = _IN_STRING.search(text, i)
                if m is None:
                    i = n
                    break
                i = m.start()
                if text[i] == "\\":
                    if i + 1 == n:  # the escaped character is in the next piece: read the backslash then
                        break
                    i += 2
                    continue
                self._in_string = False
                i += 1
                continue
            m = _STRUCTURE.search(text, i)
            if m is None:
                i = n
                break
            i = m.start()
            ch = text[i]
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth <= 0:
                    self.num_scanned = i + 1
                    return i + 1
            i += 1
        self.num_scanned = i
        return None



class ObjectEnd(NamedTuple):
    """How a call object ended: a call (sent), or `text`, as written, that is not one."""

    is_call: bool
    text: str


class CallObject:
    """Reads one call object from the start of a stream's buffer, consuming it.

    A call to a declared tool starts once its name is read and its arguments stream as written; any
    other object (keys in another order, arguments as a JSON string, an unknown tool) is decided whole
    when it closes. `arguments_of` reads a bare arguments object of a call already started (`name[ARGS]{...}`),
    or, with no call started, an object that is not a call.
    """

    def __init__(self, mode: str = "head") -> None:
        self._mode = mode  # head | args | tail | whole
        self._scan = JsonEnd()
        self._args = ""
        self._bare = mode != "head"  # arguments only: the object ends with them

    @classmethod
    def arguments_of(cls, is_open: bool) -> CallObject:
        return cls("args" if is_open else "whole")

    def step(self, stream: ToolCallStream, events: list[Event]) -> ObjectEnd | None:
        """Read what the buffer holds; the end once the object closed, None while it is open."""
        while True:
            buf = stream._buf
            if self._mode == "head":
                m = CALL_HEAD.match(buf)
                if m is not None:
                    name = unescape_name(m.group(1))
                    if stream.is_tool(name):
                        assert name is not None
                        stream._start(name, events)
                        stream._buf, self._mode, self._scan = buf[m.end():], "args", JsonEnd()
                        continue
                    self._mode = "whole"
                    continue
                end = self._scan.scan(buf)
                if end is not None:
                    return self._decide(stream, end, events)
                if len(buf) > MAX_HEAD_CHARS:
                    self._mode = "whole"
                return None
            end = self._scan.scan(buf)
            if self._mode == "args":
                stream._send_args(buf if end is None else buf[:end], events)
                if end is None:
                    return None
                self._args, stream._buf = buf[:end], buf[end:]
                if self._bare:
                    stream._close(self._args, events)
                    return ObjectEnd(True, "")
                self._mode, self._scan = "tail", JsonEnd(depth=1)
                continue
            if end is None:
                return None
            if self._mode == "tail":  # keys after the arguments (Mistral's "id"): read past them
                stream._buf = buf[end:]
                stream._close(self._args, events)
                return ObjectEnd(True, "")
            return self._decide(stream, end, events)

    def end(self, stream: ToolCallStream, events: list[Event]) -> bool:
        """The output ended inside the object: True if it still makes a call (its arguments were whole)."""
        if self._mode == "tail":
            stream._close(self._args, events)
            return True
        return False

    def _decide(self, stream: ToolCallStream, end: int, events: list[Event]) -> ObjectEnd:
        text, stream._buf = stream._buf[:end], stream._buf[end:]
        decoded = None if self._bare else decode_tool_call(text, stream._names)
        if decoded is None:
            return ObjectEnd(False, text)
        stream._whole_call(*decoded, events)
        return ObjectEnd(True, "")
