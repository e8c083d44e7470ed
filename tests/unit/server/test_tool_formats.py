"""Tool-call parsing of the Llama 3 JSON and Mistral formats, whole and streamed
(server/turn/tool_calls/llama.py, mistral.py); the event contract is Hermes' (test_tool_parser.py)."""

from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessionserve.server.turn.tool_calls import has_call_markup, parse_output, tool_call_stream
from sessionserve.server.turn.types import ToolCallDelta, ToolCallEnd, ToolCallStart
from sessionserve.types.guided import ToolFormat
from tests.unit.server.test_tool_parser import expected, run_stream, split_output

NAMES = {"get_weather", "search"}
LLAMA, MISTRAL, MISTRAL_ARGS = ToolFormat.LLAMA3_JSON, ToolFormat.MISTRAL, ToolFormat.MISTRAL_ARGS


def llama_call(name: str, args: Any, key: str = "parameters") -> str:
    return json.dumps({"name": name, key: args}, ensure_ascii=False)


def parsed(text: str, fmt: ToolFormat, names: set[str] | None = NAMES,
           ) -> tuple[str | None, list[tuple[str, Any]], bool]:
    content, calls, cut = parse_output(text, names, fmt)
    return content, [(c.name, json.loads(c.arguments)) for c in calls], cut


# --- Llama 3 JSON ---

def test_llama_reply_is_the_call() -> None:
    assert parsed(llama_call("get_weather", {"city": "Paris"}), LLAMA) == (None, [("get_weather", {"city": "Paris"})],
                                                                           False)
    tagged = "<|python_tag|>" + llama_call("search", {"q": "x"}, key="arguments")
    assert parsed(tagged, LLAMA) == (None, [("search", {"q": "x"})], False)
    # Llama 3.2 sometimes says the type too; arguments as a JSON string.
    quirky = '{"type": "function", "name": "search", "parameters": "{\\"q\\": 1}"}'
    assert parsed(quirky, LLAMA) == (None, [("search", {"q": 1})], False)


def test_llama_calls_separated_by_semicolons() -> None:
    text = "  " + llama_call("search", {"q": "}{"}) + "; " + llama_call("get_weather", {}) + ";\n" + \
        llama_call("search", {"q": [1, {"a": "\\"}]})
    assert parsed(text, LLAMA)[1] == [("search", {"q": "}{"}), ("get_weather", {}), ("search", {"q": [1, {"a": "\\"}]})]
    content, calls, cut = parse_output(text, NAMES, LLAMA)
    assert calls[0].arguments == '{"q": "}{"}' and content is None and not cut  # as written


def test_llama_text_and_objects_that_are_not_calls_are_content() -> None:
    assert parsed("The weather is fine.", LLAMA) == ("The weather is fine.", [], False)
    assert parsed('{"answer": 42}', LLAMA) == ('{"answer": 42}', [], False)
    unknown = llama_call("rm_rf", {})
    assert parsed(unknown, LLAMA) == (unknown, [], False)
    assert parsed(unknown, LLAMA, names=None) == (None, [("rm_rf", {})], False)
    # Text that follows the calls is content; `<|python_tag|>` starts calls again, and is never content.
    text = llama_call("search", {"q": 1}) + "\nDone. <|python_tag|>" + llama_call("get_weather", {}) + " Bye"
    assert parsed(text, LLAMA) == ("Done.  Bye", [("search", {"q": 1}), ("get_weather", {})], False)
    assert parsed("<|python_tag|>import math", LLAMA) == ("import math", [], False)


def test_llama_cut_call_is_dropped() -> None:
    first = llama_call("search", {"q": 1})
    assert parsed(first + '; {"name": "get_weather", "parameters": {"city": "Par', LLAMA) == \
        (None, [("search", {"q": 1})], True)
    assert parsed(first + "; ", LLAMA) == (None, [("search", {"q": 1})], True)
    assert parsed('{"answer": [1, 2', LLAMA) == (None, [], True)
    # The arguments closed, the call object not: a call.
    assert parsed('{"name": "search", "parameters": {"q": 2}', LLAMA) == (None, [("search", {"q": 2})], False)


def test_llama_arguments_stream_as_written() -> None:
    parser = tool_call_stream(LLAMA, NAMES)
    assert parser.feed('<|python_tag|>{"name": "search", "parame') == []
    events = parser.feed('ters": {"q": "a')
    assert [type(e) for e in events] == [ToolCallStart, ToolCallDelta] and events[1].arguments == '{"q": "a'
    assert parser.feed('b"}') == [ToolCallDelta(0, 'b"}')]  # the arguments are whole: nothing held back
    events = parser.feed("}")
    assert [type(e) for e in events] == [ToolCallEnd] and events[0].call.arguments == '{"q": "ab"}'


# --- Mistral ---

def test_mistral_list() -> None:
    text = ('Let me see. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich"}, "id": "a1b2c3d4e"}, '
            '{"name": "search", "arguments": {"q": "]}"}}] ')
    content, calls, cut = parse_output(text, NAMES, MISTRAL)
    assert content == "Let me see." and not cut
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Zürich"}),
                                                                  ("search", {"q": "]}"})]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.call_id) for c in calls)  # ids Mistral's templates take
    # An element that is not a call is content as written; text after the list is content.
    text = '[TOOL_CALLS][{"name": "nope", "arguments": {}}, {"name": "search", "arguments": {}}] and more'
    assert parsed(text, MISTRAL) == ('{"name": "nope", "arguments": {}} and more', [("search", {})], False)
    assert parsed("[TOOL_CALLS] not a list", MISTRAL) == ("[TOOL_CALLS] not a list", [], False)  # not calls


def test_mistral_name_args() -> None:
    text = 'On it.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[CALL_ID]a1b2c3d4e[ARGS]{"q": 1}'
    assert parsed(text, MISTRAL_ARGS) == ("On it.", [("get_weather", {"city": "Paris"}), ("search", {"q": 1})], False)
    # A decoder that drops [ARGS] leaves `name{...}`.
    assert parsed('[TOOL_CALLS]search{"q": 2}', MISTRAL_ARGS) == (None, [("search", {"q": 2})], False)
    # A call to an unknown tool is content as written, markers and all.
    unknown = '[TOOL_CALLS]rm_rf[ARGS]{"path": "/"}'
    assert parsed(unknown + " ok", MISTRAL_ARGS) == (unknown + " ok", [], False)
    # The parser reads both forms whichever the template names.
    assert parsed('[TOOL_CALLS]search[ARGS]{"q": 3}', MISTRAL) == (None, [("search", {"q": 3})], False)


def test_mistral_cut_call_is_dropped() -> None:
    assert parsed('Hm [TOOL_CALLS] [{"name": "search", "arguments": {"q": 1}}, {"name": "get_w', MISTRAL) == \
        ("Hm", [("search", {"q": 1})], True)
    assert parsed('[TOOL_CALLS]search[ARGS]{"q": 1}[TOOL_CALLS]get_weather[ARGS]{"ci', MISTRAL_ARGS) == \
        (None, [("search", {"q": 1})], True)
    assert parsed("[TOOL_CALLS]sea", MISTRAL_ARGS) == (None, [], True)
    assert parsed("[TOOL_C", MISTRAL_ARGS) == ("[TOOL_C", [], False)  # not the marker: text


def test_mistral_arguments_stream_as_written() -> None:
    parser = tool_call_stream(MISTRAL_ARGS, NAMES)
    assert parser.feed("[TOOL_CALLS]sea") == []
    events = parser.feed('rch[ARGS]{"q": ')
    assert [type(e) for e in events] == [ToolCallStart, ToolCallDelta] and events[0].name == "search"
    events = parser.feed('1}[TOOL_')
    assert events[0] == ToolCallDelta(0, "1}") and isinstance(events[1], ToolCallEnd)


def test_call_markup_of_any_family() -> None:
    for text in ("<tool_call>{oops", "[TOOL_CALLS] [{", "<|python_tag|>{", ' {"name": "f", "par'):
        assert has_call_markup(text)
    for text in ("Hello", '{"answer": 1}', "a {\"name\": 1}"):
        assert not has_call_markup(text)


# --- stream == whole, however split ---

def _args() -> st.SearchStrategy[dict[str, Any]]:
    values = st.one_of(st.integers(), st.text("a{}[]\"\\ ,", max_size=4))
    return st.dictionaries(st.sampled_from(["q", "ü", "}"]), values, max_size=3)


_names = st.sampled_from(sorted(NAMES) + ["unknown"])
_llama_piece = st.one_of(
    st.lists(st.sampled_from([*'ab {}[]";:\n', "<|python_tag|>", "<|python", '"name"']), max_size=8).map("".join),
    st.builds(llama_call, _names, _args()),
    st.builds(lambda n, a: llama_call(n, a, key="arguments"), _names, _args()),
    st.just("; "),
    st.just('{"name": "search", "parameters": {"q": '),  # cut short
)
_mistral_piece = st.one_of(
    st.lists(st.sampled_from(list("ab {}[]\",\n") + ["[TOOL_CALLS]", "[ARGS]", "[TOOL"]), max_size=8).map("".join),
    st.builds(lambda calls: "[TOOL_CALLS] [" + ", ".join(json.dumps({"name": n, "arguments": a}) for n, a in calls)
              + "]", st.lists(st.tuples(_names, _args()), min_size=1, max_size=3)),
    st.builds(lambda n, a: f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}", _names, _args()),
    st.just('[TOOL_CALLS]search[ARGS]{"q": [1'),  # cut short
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split_output(_llama_piece), st.sampled_from([NAMES, None]))
def test_llama_stream_equals_whole_however_split(case: tuple[str, list[str]], names: set[str] | None) -> None:
    text, pieces = case
    assert run_stream(pieces, names, LLAMA) == expected(text, names, LLAMA)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split_output(_mistral_piece), st.sampled_from([NAMES, None]), st.sampled_from([MISTRAL, MISTRAL_ARGS]))
def test_mistral_stream_equals_whole_however_split(case: tuple[str, list[str]], names: set[str] | None,
                                                   fmt: ToolFormat) -> None:
    text, pieces = case
    assert run_stream(pieces, names, fmt) == expected(text, names, fmt)
