"""Tool calls of the model families users load, checked against transformers' `apply_chat_template`.

For each family a chat template in its published format (`chat_templates/*.jinja`, written for these
tests) sits in a model folder with a byte-level tokenizer that holds the family's markers as added
tokens. Then:
(a) our Tokenizer renders conversations (system, user, assistant calls, tool results, tools) to the
    same text as transformers, with arguments as objects (transformers' form) or JSON text (OpenAI's);
(b) a reply in the family's format, tokenized and detokenized as the engine streams it, parses to its calls;
(c) a conversation's assistant calls, rendered by the template and read back, are the same calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from jinja2.exceptions import TemplateError
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from sessionserve.modelgen.make_model import read_chat_template
from sessionserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
from sessionserve.server.turn.tool_calls import tool_call_stream
from sessionserve.types.guided import ToolFormat, tool_format_of

transformers = pytest.importorskip("transformers")

TEMPLATES = Path(__file__).parent / "chat_templates"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                                          "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time",
                                      "parameters": {"type": "object", "properties": {}}}},
]
NAMES = {"get_weather", "get_time"}
CALLS = [("get_weather", {"city": "Zürich", "unit": "c"}), ("get_time", {})]


@dataclass(frozen=True)
class Family:
    name: str
    tool_format: ToolFormat
    special: tuple[str, ...]  # special tokens (skipped when decoding, but for the tool markers)
    added: tuple[str, ...]  # added tokens decoded as text
    bos: str | None
    eos: str
    reply_after: str  # what the template writes right before an assistant reply
    reply: str  # a model's reply with CALLS in the family's format, up to its stop token
    max_calls: int  # calls one assistant message may hold in the template


FAMILIES = [
    Family("hermes", ToolFormat.HERMES, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
           ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"), None, "<|im_end|>",
           "<|im_start|>assistant\n",
           'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}\n'
           '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>', 2),
    Family("llama3_json", ToolFormat.LLAMA3_JSON,
           ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
            "<|python_tag|>"), (), "<|begin_of_text|>", "<|eot_id|>",
           "<|start_header_id|>assistant<|end_header_id|>\n\n",
           '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich", "unit": "c"}}; '
           '{"name": "get_time", "parameters": {}}<|eom_id|>', 1),
    Family("mistral", ToolFormat.MISTRAL,
           ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), (), "<s>", "</s>", "[/INST]",
           '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}, '
           '{"name": "get_time", "arguments": {}}]</s>', 2),
    Family("mistral_args", ToolFormat.MISTRAL_ARGS,
           ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[ARGS]", "[CALL_ID]"),
           (), "<s>", "</s>", "[/INST]",
           'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "unit": "c"}[TOOL_CALLS]get_time[ARGS]{}</s>', 2),
]


def make_model_dir(path: Path, family: Family) -> Path:
    """A model folder (tokenizer only) of the family: bytes as tokens, the family's markers as added tokens."""
    path.mkdir()
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": family.eos,
              "chat_template": (TEMPLATES / f"{family.name}.jinja").read_text()}
    if family.bos is not None:
        config["bos_token"] = family.bos
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(params=FAMILIES, ids=[f.name for f in FAMILIES])
def family(request: pytest.FixtureRequest) -> Family:
    return request.param


@pytest.fixture
def tokenizers(family: Family, tmp_path: Path) -> tuple[Tokenizer, Any]:
    path = make_model_dir(tmp_path / family.name, family)
    return Tokenizer(path), transformers.AutoTokenizer.from_pretrained(str(path))


def call_ids(family: Family) -> list[str]:
    return ["a1B2c3D4e", "f5G6h7I8j"] if family.tool_format in (ToolFormat.MISTRAL, ToolFormat.MISTRAL_ARGS) \
        else ["call_1", "call_2"]


def assistant_calls(family: Family, calls: list[tuple[str, dict[str, Any]]], as_text: bool) -> dict[str, Any]:
    """An assistant message with `calls`: arguments as JSON text (OpenAI's form) or objects (transformers')."""
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function",
         "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False) if as_text else args}}
        for call_id, (name, args) in zip(call_ids(family), calls)]}


def conversation(family: Family, as_text: bool) -> list[dict[str, Any]]:
    calls = CALLS[:family.max_calls]
    ids = call_ids(family)
    results = [{"role": "tool", "tool_call_id": i, "content": r} for i, r in zip(ids, ('{"temp": 21}', '"12:00"'))]
    return [
        {"role": "system", "content": "You help with the weather."},
        {"role": "user", "content": "Weather in Zürich, and the time?"},
        assistant_calls(family, calls, as_text),
        *results[:len(calls)],
        {"role": "assistant", "content": "It is 21 °C and noon."},
        {"role": "user", "content": "Thanks! Again, please."},
    ]


def test_format_detected_from_the_template(family: Family) -> None:
    assert tool_format_of((TEMPLATES / f"{family.name}.jinja").read_text()) is family.tool_format
    assert tool_format_of(read_chat_template()) is ToolFormat.HERMES  # the embedded models'


def test_renders_as_transformers(family: Family, tokenizers: tuple[Tokenizer, Any]) -> None:
    ours, hf = tokenizers
    assert ours.tool_format is family.tool_format
    cases: list[dict[str, Any]] = [
        dict(messages=conversation(family, as_text=False), tools=TOOLS, add_generation_prompt=True),
        dict(messages=conversation(family, as_text=False), tools=None, add_generation_prompt=True),
        dict(messages=conversation(family, as_text=False)[:3], tools=TOOLS, add_generation_prompt=False),
        dict(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, add_generation_prompt=True),
        dict(messages=[{"role": "user", "content": "hi"}], tools=None, add_generation_prompt=True),
    ]
    for case in cases:
        want = hf.apply_chat_template(case["messages"], tools=case["tools"], tokenize=False,
                                      add_generation_prompt=case["add_generation_prompt"])
        assert ours.apply_chat_template(case["messages"], tools=case["tools"],
                                        add_generation_prompt=case["add_generation_prompt"]) == want
    # Arguments as OpenAI sends them (JSON text) render as transformers renders the objects.
    want = hf.apply_chat_template(conversation(family, as_text=False), tools=TOOLS, tokenize=False,
                                  add_generation_prompt=True)
    assert ours.apply_chat_template(conversation(family, as_text=True), tools=TOOLS) == want
    assert "Zürich" in want and "Weather <now> & later" in want  # not escaped


def test_template_errors_as_transformers(family: Family, tokenizers: tuple[Tokenizer, Any]) -> None:
    ours, hf = tokenizers
    if family.name == "hermes":
        return  # the ChatML template takes any message
    # Two calls in one message (Llama takes one), ids of another length (Mistral's), a role without a turn.
    call = {"id": "x", "type": "function", "function": {"name": "get_time", "arguments": {}}}
    bad = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call, call]},
           {"role": "narrator", "content": "y"}]
    with pytest.raises(TemplateError) as theirs:
        hf.apply_chat_template(bad, tools=TOOLS, tokenize=False)
    with pytest.raises(TemplateError) as mine:
        ours.apply_chat_template(bad, tools=TOOLS)
    assert str(mine.value) == str(theirs.value)


def stream_reply(ours: Tokenizer, text: str) -> list[str]:
    """The text deltas the engine streams for a reply: its tokens up to the stop token, one at a time."""
    ids = ours.encode(text, add_special_tokens=False)
    stops = {ours.eos_token_id, ours.token_to_id("<|eom_id|>")} - {None}
    ids = ids[:next((i for i, t in enumerate(ids) if t in stops), len(ids))]
    detok = IncrementalDetokenizer(ours)
    return [detok.add([t], finished=i == len(ids) - 1) for i, t in enumerate(ids)]


def read_calls(ours: Tokenizer, text: str) -> tuple[str | None, list[tuple[str, dict[str, Any]]], bool]:
    parser = tool_call_stream(ours.tool_format, NAMES)
    for delta in stream_reply(ours, text):
        parser.feed(delta)
    parser.finish()
    return parser.content, [(c.name, json.loads(c.arguments)) for c in parser.calls], parser.is_cut


def test_reply_parses_to_its_calls(family: Family, tokenizers: tuple[Tokenizer, Any]) -> None:
    ours, _ = tokenizers
    content, calls, cut = read_calls(ours, family.reply)
    assert calls == CALLS and not cut
    assert content == {"hermes": "Checking.", "mistral_args": "Sure."}.get(family.name)
    # Cut by the token limit inside the last call: the calls before it only, none of its markup as content.
    cut_at = family.reply.rindex("get_time") + 3
    content, calls, cut = read_calls(ours, family.reply[:cut_at])
    assert calls == CALLS[:1] and cut
    assert content == {"hermes": "Checking.", "mistral_args": "Sure."}.get(family.name)


def test_rendered_calls_read_back(family: Family, tokenizers: tuple[Tokenizer, Any]) -> None:
    ours, _ = tokenizers
    messages = conversation(family, as_text=True)[:3]
    prompt = ours.apply_chat_template(messages[:2], tools=TOOLS, add_generation_prompt=True)
    assert prompt.endswith(family.reply_after)
    rendered = ours.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=False)
    reply = rendered[rendered.rindex(family.reply_after) + len(family.reply_after):]
    content, calls, cut = read_calls(ours, reply)
    assert calls == CALLS[:family.max_calls] and content is None and not cut
