"""Tool-call parsing of Qwen/Hermes `<tool_call>` blocks, whole and streamed."""

from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessionserve.server.tool_parser import StreamingToolParser, parse_tool_calls

NAMES = {"get_weather", "search"}
ID = re.compile(r"call_[A-Za-z0-9_-]{24}")


def block(name: str, args: Any, key: str = "arguments") -> str:
    return f'<tool_call>\n{json.dumps({"name": name, key: args}, ensure_ascii=False)}\n</tool_call>'


def calls_of(calls: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    for c in calls:
        assert ID.fullmatch(c["id"]) and c["type"] == "function"
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_one_call() -> None:
    content, calls = parse_tool_calls(block("get_weather", {"city": "Paris"}), NAMES)
    assert content is None
    assert calls_of(calls) == [("get_weather", {"city": "Paris"})]
    assert isinstance(calls[0]["function"]["arguments"], str)


def test_several_calls_with_text_before_and_after() -> None:
    text = ("Let me check.\n\n" + block("get_weather", {"city": "Paris"}) + "\n"
            + block("search", {"q": "x", "n": [1, 2]}) + "\nDone.\n")
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me check.\n\n\n\nDone."
    assert calls_of(calls) == [("get_weather", {"city": "Paris"}), ("search", {"q": "x", "n": [1, 2]})]
    assert len({c["id"] for c in calls}) == 2


def test_no_calls_is_plain_content() -> None:
    assert parse_tool_calls("  just text \n", NAMES) == ("just text", [])
    assert parse_tool_calls("", NAMES) == (None, [])


def test_malformed_json_stays_content() -> None:
    bad = '<tool_call>\n{"name": "search", "arguments": {"q": }\n</tool_call>'
    content, calls = parse_tool_calls("a " + bad + block("search", {"q": 1}), NAMES)
    assert content == "a " + bad
    assert calls_of(calls) == [("search", {"q": 1})]


def test_unknown_tool_or_missing_name_stays_content() -> None:
    unknown = block("rm_rf", {})
    assert parse_tool_calls(unknown, NAMES) == (unknown, [])
    # Without a name set, any name is a call.
    assert calls_of(parse_tool_calls(unknown, None)[1]) == [("rm_rf", {})]
    nameless = '<tool_call>{"arguments": {}}</tool_call>'
    assert parse_tool_calls(nameless, None) == (nameless, [])
    not_object = "<tool_call>[1, 2]</tool_call>"
    assert parse_tool_calls(not_object, None) == (not_object, [])
    bad_args = block("search", [1, 2])
    assert parse_tool_calls(bad_args, NAMES) == (bad_args, [])
    nan_args = '<tool_call>{"name": "search", "arguments": {"x": NaN}}</tool_call>'
    assert parse_tool_calls(nan_args, NAMES) == (nan_args, [])


def test_unterminated_block_stays_content() -> None:
    text = "ok " + block("search", {"q": 1}) + " then <tool_call>\n{\"name\": \"search\", \"argu"
    content, calls = parse_tool_calls(text, NAMES)
    assert content == 'ok  then <tool_call>\n{"name": "search", "argu'
    assert calls_of(calls) == [("search", {"q": 1})]


def test_unicode_arguments() -> None:
    args = {"city": "Zürich", "note": "東京 🌧", "quote": 'a "b" \\ c'}
    content, calls = parse_tool_calls("Météo : " + block("get_weather", args), NAMES)
    assert content == "Météo :"
    assert calls_of(calls) == [("get_weather", args)]
    assert "Zürich" in calls[0]["function"]["arguments"]  # not \u-escaped


def test_arguments_as_json_string_or_missing() -> None:
    _, calls = parse_tool_calls(block("search", json.dumps({"q": "x"})), NAMES)
    assert calls_of(calls) == [("search", {"q": "x"})]
    not_json = block("search", "q=x")
    assert parse_tool_calls(not_json, NAMES) == (not_json, [])
    _, calls = parse_tool_calls('<tool_call>{"name": "search"}</tool_call>', NAMES)
    assert calls_of(calls) == [("search", {})]
    _, calls = parse_tool_calls(block("search", {"q": 2}, key="parameters"), NAMES)
    assert calls_of(calls) == [("search", {"q": 2})]


# --- streaming ---

def run_stream(pieces: list[str], names: set[str] | None) -> tuple[str, list[tuple[str, str]], list[dict[str, Any]]]:
    """(joined content, [(name, arguments)] reassembled from deltas, raw events)."""
    parser = StreamingToolParser(names)
    events: list[dict[str, Any]] = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    content = ""
    calls: dict[int, list[str]] = {}
    for ev in events:
        assert len(ev) == 1
        if "content" in ev:
            assert ev["content"]
            content += ev["content"]
            continue
        (delta,) = ev["tool_calls"]
        if delta["index"] not in calls:
            assert delta["index"] == len(calls)  # indices count up from 0
            assert ID.fullmatch(delta["id"]) and delta["type"] == "function"
            assert delta["function"]["arguments"] == ""
            calls[delta["index"]] = [delta["function"]["name"], ""]
        else:
            assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
            calls[delta["index"]][1] += delta["function"]["arguments"]
    return content, [(n, a) for n, a in calls.values()], events


def expected(text: str, names: set[str] | None) -> tuple[str, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text, names)
    return content or "", [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_stream_holds_back_partial_start_tag() -> None:
    parser = StreamingToolParser(NAMES)
    assert parser.feed("Hi <tool") == [{"content": "Hi"}]  # " <tool" held: may be a tag
    assert parser.feed("box> x") == [{"content": " <toolbox> x"}]
    assert parser.feed(" <tool_call>{\"name\": \"search\"") == []
    events = parser.feed(', "arguments": {"q": 1}}</tool_call>')
    assert [list(e) for e in events] == [["tool_calls"], ["tool_calls"]]
    assert events[1]["tool_calls"][0]["function"]["arguments"] == '{"q": 1}'
    assert parser.finish() == []
    assert len(parser.tool_calls) == 1


def test_stream_unterminated_block_flushed_as_content() -> None:
    text = 'Sure. <tool_call>\n{"name": "search", "arguments": {"q"'
    content, calls, _ = run_stream(list(text), NAMES)
    assert (content, calls) == expected(text, NAMES) == (text, [])


def test_stream_char_by_char_matches_whole() -> None:
    text = "Let me look.\n" + block("search", {"q": "ü"}) + "\n" + block("nope", {}) + "\n" + block("get_weather", {})
    assert run_stream(list(text), NAMES)[:2] == expected(text, NAMES)
    assert run_stream([text], NAMES)[:2] == expected(text, NAMES)


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
def split_output(draw: st.DrawFn) -> tuple[str, list[str]]:
    text = "".join(draw(st.lists(_piece, max_size=6)))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    return text, [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split_output(), st.sampled_from([NAMES, None]))
def test_stream_equals_whole_however_split(case: tuple[str, list[str]], names: set[str] | None) -> None:
    text, pieces = case
    assert "".join(pieces) == text
    content, calls, _ = run_stream(pieces, names)
    assert (content, calls) == expected(text, names)
