"""The chat template environment (model/tokenizer.py) is transformers' `apply_chat_template`'s: the same
templates render the same text, errors included; and decoding keeps the tool format's marker tokens."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from jinja2.exceptions import SecurityError, TemplateError
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from sessionserve.model.tokenizer import Tokenizer
from sessionserve.types.guided import ToolFormat

transformers = pytest.importorskip("transformers")
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße <b>&</b>"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "f", "arguments": {"b": [1, 2], "a": "é"}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"}, {"role": "user", "content": "again"}]
TEMPLATES = {
    "loop controls": "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                     "{% if m.role == 'tool' %}{% break %}{% endif %}[{{ m.role }}]{% endfor %}",
    "strftime_now": "{{ strftime_now('%Y-%m-%d') }}",
    "tojson": "{% for m in messages %}{{ m | tojson }}\n{{ m | tojson(indent=2, sort_keys=true) }}\n"
              "{{ m | tojson(ensure_ascii=true, separators=(',', ':')) }}\n{% endfor %}",
    "missing keys": "{% for m in messages %}{{ m.content is defined }} {{ m.content is none }};{% endfor %}",
    "generation": "{% for m in messages %}{% if m.role == 'user' %}{% generation %}{{ m.content }}"
                  "{% endgeneration %}{% endif %}{% endfor %}",
    "tokens": "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token is defined }}|{{ documents is none }}",
    "namespace and dict": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                          "{{ ns.n }} {{ dict(a=1) | tojson }}",
}


def model_dir(path: Path, template: str, special: tuple[str, ...] = ("<s>", "</s>", "<pad>")) -> Path:
    path.mkdir(exist_ok=True)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "chat_template": template}))
    return path


def transformers_render(path: Path, **kwargs: Any) -> str:
    return transformers.AutoTokenizer.from_pretrained(str(path)).apply_chat_template(tokenize=False, **kwargs)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_renders_as_transformers(name: str, tmp_path: Path) -> None:
    path = model_dir(tmp_path / "m", TEMPLATES[name])
    want = transformers_render(path, conversation=MESSAGES)
    assert Tokenizer(path).apply_chat_template(MESSAGES, add_generation_prompt=False) == want
    if name == "strftime_now":
        assert want == datetime.now().strftime("%Y-%m-%d")
    if name == "loop controls":
        assert want == "[user][assistant]"


def test_raise_exception_as_transformers(tmp_path: Path) -> None:
    path = model_dir(tmp_path / "m", "{{ raise_exception('no ' + messages[0].role) }}")
    with pytest.raises(TemplateError, match="^no system$"):
        transformers_render(path, conversation=MESSAGES)
    with pytest.raises(TemplateError, match="^no system$"):
        Tokenizer(path).apply_chat_template(MESSAGES)
    # The sandbox holds as in transformers.
    for i, template in enumerate(("{{ ''.__class__.__mro__ }}", "{% set ns = namespace(_a=1) %}",
                                  "{% set ns = namespace() %}{% set ns.__init__ = 1 %}")):
        with pytest.raises(SecurityError):
            render_jinja_template([MESSAGES], chat_template=template)
        with pytest.raises(SecurityError):
            Tokenizer(model_dir(tmp_path / f"s{i}", template)).apply_chat_template(MESSAGES)


def test_arguments_as_json_text_read_as_an_object_or_as_the_text(tmp_path: Path) -> None:
    text = '{"b":[1, 2],  "a": "é"}'  # as a model wrote it
    messages = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": text}}]}]
    template = ("{% set args = messages[0].tool_calls[0].function.arguments %}"
                "{{ args | tojson }}|{{ args }}|{{ 'x' + args }}|{{ args is string }}|{{ args is mapping }}|"
                "{{ args.b[1] }}|{% for k, v in args | items %}{{ k }}={{ v }},{% endfor %}|"
                "{{ args | tojson(indent=1) }}|{{ messages[0].tool_calls[0].function | tojson }}")
    out = Tokenizer(model_dir(tmp_path / "m", template)).apply_chat_template(messages)
    assert out.split("|") == [text, text, "x" + text, "False", "True", "2", "b=[1, 2],a=é,",
                              json.dumps(json.loads(text), indent=1, ensure_ascii=False),
                              '{"name": "f", "arguments": {"b": [1, 2], "a": "é"}}']
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == text  # the caller's messages untouched
    # Text that is not a JSON object stays text.
    plain = Tokenizer(model_dir(tmp_path / "p", "{{ messages[0].tool_calls[0].function.arguments is string }}"))
    for raw in ("q=x", "[1]"):
        messages = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": raw}}]}]
        assert plain.apply_chat_template(messages) == "True"


def test_decode_keeps_the_tool_markers_only(tmp_path: Path) -> None:
    special = ("<s>", "</s>", "<pad>", "[TOOL_CALLS]", "[INST]")
    mistral = Tokenizer(model_dir(tmp_path / "mistral", "[INST]{{ messages[0].content }}[TOOL_CALLS]", special))
    assert mistral.tool_format is ToolFormat.MISTRAL
    ids = mistral.encode("<s>[INST]hi[TOOL_CALLS] [{}]</s>", add_special_tokens=False)
    assert mistral.decode(ids) == "hi[TOOL_CALLS] [{}]"
    assert mistral.decode(ids, skip_special_tokens=False) == "<s>[INST]hi[TOOL_CALLS] [{}]</s>"
    plain = Tokenizer(model_dir(tmp_path / "plain", "[INST]{{ messages[0].content }}", special))
    assert plain.tool_format is ToolFormat.HERMES and plain.decode(ids) == "hi [{}]"
