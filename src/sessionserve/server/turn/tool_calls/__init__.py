"""Model output to text and tool-call events, as it is generated, in the format of the model's family.

A model writes tool calls the way its chat template shows them
(`types.guided.ToolFormat`, read off the template by `tool_format_of`):

    hermes.py   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`  (Qwen, Hermes, the embedded models)
    llama.py    `{"name": ..., "parameters": {...}}` as the reply, `;` between calls  (Llama 3.x)
    mistral.py  `[TOOL_CALLS] [{...}, ...]` or `[TOOL_CALLS]name[ARGS]{...}`  (Mistral)
    stream.py   what they share: the events, the content, the calls
    call_object.py  a JSON call object read as it streams (the formats without an end tag)

Every format's `ToolCallStream` reads the output's text deltas and yields
the same events, `TextDelta`, `ToolCallStart`, `ToolCallDelta` and
`ToolCallEnd`:

- A call to a declared tool starts as soon as its name has been read, and its
  arguments stream as the model writes them, returned as written: a client
  that sends them back sends the model's own text. Markup that does not read
  as a call as it streams is decided when it ends: a valid call is sent whole;
  anything else stays in the content as the model wrote it.
- A call cut by the end of the output (a token limit) is not a call: no
  `ToolCallEnd`, and none of its markup reaches the content (`is_cut`). Calls
  completed before it are calls.
- Content is the text outside calls, stripped of leading and trailing
  whitespace, streamed so its pieces join to exactly that.

Nothing here raises on model output. `parse_output` runs the same on a
finished text, so a stream however split and the finished reply agree.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from sessionserve.server.turn.tool_calls.hermes import HermesCallStream
from sessionserve.server.turn.tool_calls.llama import PYTHON_TAG, LlamaJsonCallStream
from sessionserve.server.turn.tool_calls.mistral import TOOL_CALLS, MistralCallStream
from sessionserve.server.turn.tool_calls.stream import (
    Event,
    ToolCallStream,
    decode_tool_call,
    loads_json,
    new_call_id,
    parse_with,
)
from sessionserve.server.turn.types import ToolCall
from sessionserve.types.guided import ToolFormat

__all__ = ["Event", "ToolCallStream", "decode_tool_call", "has_call_markup", "loads_json", "new_call_id",
           "parse_output", "tool_call_stream"]

# A reply that opens as a call object (Llama 3's calls have no marker).
_CALL_OBJECT = re.compile(r'\s*\{\s*"name"\s*:')

_STREAMS: dict[ToolFormat, type[ToolCallStream]] = {
    ToolFormat.HERMES: HermesCallStream,
    ToolFormat.LLAMA3_JSON: LlamaJsonCallStream,
    ToolFormat.MISTRAL: MistralCallStream,
    ToolFormat.MISTRAL_ARGS: MistralCallStream,
}


def tool_call_stream(format: ToolFormat, tool_names: Iterable[str] | None) -> ToolCallStream:
    """A parser of one output written in `format`; `tool_names` None accepts calls to any name."""
    return _STREAMS[format](tool_names)


def parse_output(text: str, tool_names: Iterable[str] | None, format: ToolFormat = ToolFormat.HERMES,
                 ) -> tuple[str | None, list[ToolCall], bool]:
    """(content, complete calls, whether a call was cut) of a finished output: the stream's result."""
    return parse_with(tool_call_stream(format, tool_names), text)


def has_call_markup(text: str) -> bool:
    """Whether an output tried to write a tool call, in any family's format (to tell a malformed call
    from a plain answer when none parsed)."""
    return any(m in text for m in ("<tool_call>", TOOL_CALLS, PYTHON_TAG)) or _CALL_OBJECT.match(text) is not None
