"""Tool-call parsing of Qwen/Hermes `<tool_call>` blocks, whole and streamed (server/turn/tool_calls/hermes.py)."""

from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessionserve.server.turn.tool_calls import parse_output, tool_call_stream
from sessionserve.server.turn.types import TextDelta, ToolCall, ToolCallDelta, ToolCallEnd, ToolCallStart
from sessionserve.types.guided import ToolFormat

NAMES = {"get_weather", "search"}
ID = re.compile(r"call_[A-Za-z0-9_-]{24}")


def block(name: str, args: Any, key: str = "arguments") -> str:
    return f'<tool_call>\n{json.dumps({"name": name, key: args}, ensure_ascii=False)}\n</tool_call>'


def parse(text: str, names: set[str] | None) -> tuple[str | None, list[ToolCall], bool]:
    return parse_output(text, names, ToolFormat.HERMES)


def calls_of(calls: list[ToolCall]) -> list[tuple[str, dict[str, Any]]]:
    for c in calls:
        assert ID.fullmatch(c.call_id)
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_one_call() -> None:
    content, calls, cut = parse(block("get_weather", {"city": "Paris"}), NAMES)
    assert content is None and not cut
    assert calls_of(calls) == [("get_weather", {"city": "Paris"})]
    assert calls[0].arguments == '{"city": "Paris"}'  # the model's text


def test_several_calls_with_text_before_and_after() -> None:
    text = ("Let me check.\n\n" + block("get_weather", {"city": "Paris"}) + "\n"
            + block("search", {"q": "x", "n": [1, 2]}) + "\nDone.\n")
    content, calls, _ = parse(text, NAMES)
    assert content == "Let me check.\n\n\n\nDone."
    assert calls_of(calls) == [("get_weather", {"city": "Paris"}), ("search", {"q": "x", "n": [1, 2]})]
    assert len({c.call_id for c in calls}) == 2


def test_no_calls_is_plain_content() -> None:
    assert parse("  just text \n", NAMES) == ("just text", [], False)
    assert parse("", NAMES) == (None, [], False)


def test_malformed_json_stays_content() -> None:
    bad = '<tool_call>\n{"name": "search", arguments: {"q": 1}}\n</tool_call>'
    content, calls, _ = parse("a " + bad + block("search", {"q": 1}), NAMES)
    assert content == "a " + bad
    assert calls_of(calls) == [("search", {"q": 1})]


def test_unknown_tool_or_missing_name_stays_content() -> None:
    unknown = block("rm_rf", {})
    assert parse(unknown, NAMES) == (unknown, [], False)
    # Without a name set, any name is a call.
    assert calls_of(parse(unknown, None)[1]) == [("rm_rf", {})]
    nameless = '<tool_call>{"arguments": {}}</tool_call>'
    assert parse(nameless, None) == (nameless, [], False)
    not_object = "<tool_call>[1, 2]</tool_call>"
    assert parse(not_object, None) == (not_object, [], False)
    bad_args = block("search", [1, 2])
    assert parse(bad_args, NAMES) == (bad_args, [], False)
    # A block decided whole (here: keys in another order) is a call only if it is JSON clients can read.
    nan_args = '<tool_call>{"arguments": {"x": NaN}, "name": "search"}</tool_call>'
    assert parse(nan_args, NAMES) == (nan_args, [], False)


def test_cut_block_is_dropped() -> None:
    text = "ok " + block("search", {"q": 1}) + " then <tool_call>\n{\"name\": \"search\", \"argu"
    content, calls, cut = parse(text, NAMES)
    assert content == "ok  then" and cut
    assert calls_of(calls) == [("search", {"q": 1})]


def test_unicode_arguments() -> None:
    args = {"city": "Zürich", "note": "東京 🌧", "quote": 'a "b" \\ c'}
    content, calls, _ = parse("Météo : " + block("get_weather", args), NAMES)
    assert content == "Météo :"
    assert calls_of(calls) == [("get_weather", args)]
    assert "Zürich" in calls[0].arguments  # not \u-escaped


def test_arguments_as_json_string_or_missing() -> None:
    _, calls, _ = parse(block("search", json.dumps({"q": "x"})), NAMES)
    assert calls_of(calls) == [("search", {"q": "x"})]
    not_json = block("search", "q=x")
    assert parse(not_json, NAMES) == (not_json, [], False)
    _, calls, _ = parse('<tool_call>{"name": "search"}</tool_call>', NAMES)
    assert calls_of(calls) == [("search", {})]
    _, calls, _ = parse(block("search", {"q": 2}, key="parameters"), NAMES)
    assert calls_of(calls) == [("search", {"q": 2})]


# --- streaming ---

def run_stream(pieces: list[str], names: set[str] | None, fmt: ToolFormat = ToolFormat.HERMES,
               ) -> tuple[str, list[tuple[str, str]], bool]:
    """(joined content, [(name, arguments)] reassembled from the events, is_cut), checking the event contract."""
    parser = tool_call_stream(fmt, names)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    content = ""
    calls: dict[int, list[str]] = {}
    ended: list[ToolCall] = []
    for ev in events:
        if isinstance(ev, TextDelta):
            assert ev.text
            content += ev.text
        elif isinstance(ev, ToolCallStart):
            assert ev.index == len(calls)  # indices count up from 0, each call once
            calls[ev.index] = [ev.name, ""]
        elif isinstance(ev, ToolCallDelta):
            assert ev.arguments and ev.index == len(calls) - 1  # the open call's arguments
            calls[ev.index][1] += ev.arguments
        else:
            assert isinstance(ev, ToolCallEnd) and ev.index == len(calls) - 1
            assert (ev.call.name, ev.call.arguments) == tuple(calls[ev.index])
            ended.append(ev.call)
    assert ended == parser.calls and (content or None) == parser.content
    return content, [(c.name, c.arguments) for c in ended], parser.is_cut


def expected(text: str, names: set[str] | None, fmt: ToolFormat = ToolFormat.HERMES,
             ) -> tuple[str, list[tuple[str, str]], bool]:
    content, calls, cut = parse_output(text, names, fmt)
    return content or "", [(c.name, c.arguments) for c in calls], cut


def test_stream_holds_back_partial_start_tag() -> None:
    parser = tool_call_stream(ToolFormat.HERMES, NAMES)
    assert parser.feed("Hi <tool") == [TextDelta("Hi")]  # " <tool" held: may be a tag
    assert parser.feed("box> x") == [TextDelta(" <toolbox> x")]
    start = parser.feed(' <tool_call>{"name": "search"')
    assert start == []
    events = parser.feed(', "arguments": {"q": 1}}</tool_call>')
    assert [type(e) for e in events] == [ToolCallStart, ToolCallDelta, ToolCallEnd]
    assert events[1].arguments == '{"q": 1}'
    assert parser.finish() == []
    assert len(parser.calls) == 1 and not parser.is_cut


def test_stream_sends_arguments_as_they_are_written() -> None:
    parser = tool_call_stream(ToolFormat.HERMES, NAMES)
    assert [type(e) for e in parser.feed('<tool_call>\n{"name": "search", "arguments": ')] == []
    assert [type(e) for e in parser.feed('{"q": "a')] == [ToolCallStart, ToolCallDelta]
    assert parser.feed('b"}') == [ToolCallDelta(0, 'b"')]  # the `}`s may close the call object: held
    events = parser.feed('}\n</tool_call>')
    assert events[0] == ToolCallDelta(0, "}") and isinstance(events[1], ToolCallEnd)


def test_stream_cut_block_is_dropped() -> None:
    text = 'Sure. <tool_call>\n{"name": "search", "arguments": {"q"'
    assert run_stream(list(text), NAMES) == expected(text, NAMES) == ("Sure.", [], True)


def test_stream_char_by_char_matches_whole() -> None:
    text = "Let me look.\n" + block("search", {"q": "ü"}) + "\n" + block("nope", {}) + "\n" + block("get_weather", {})
    assert run_stream(list(text), NAMES) == expected(text, NAMES)
    assert run_stream([text], NAMES) == expected(text, NAMES)


_atoms = list("ab <>/_{}\":\n é東") + ["<tool_call>", "</tool_call>", "<tool_", "</tool", "call>"]
_text = st.lists(st.sampled_from(_atoms), max_size=12).map("".join)
_args = st.dictionaries(st.sampled_from(["q", "n", "ü"]), st.one_of(st.integers(), st.text(max_size=5)), max_size=3)
_piece = st.one_of(
    _text,
    st.builds(block, st.sampled_from(sorted(NAMES) + ["unknown"]), _args),
    st.builds(lambda a: block("search", json.dumps(a)), _args),  # arguments as a JSON string
    st.just('<tool_call>{"name": "search", "arguments": {]}</tool_call>'),  # bad JSON
    st.just("<tool_call>\n{\"name\": \"get_weather\", \"arg"),  # cut short
)


@st.composite
def split_output(draw: st.DrawFn, piece: st.SearchStrategy[str] = _piece) -> tuple[str, list[str]]:
    text = "".join(draw(st.lists(piece, max_size=6)))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    return text, [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split_output(), st.sampled_from([NAMES, None]))
def test_stream_equals_whole_however_split(case: tuple[str, list[str]], names: set[str] | None) -> None:
    text, pieces = case
    assert "".join(pieces) == text
    assert run_stream(pieces, names) == expected(text, names)
