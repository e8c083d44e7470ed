"""ToolFormat: read off a chat template's text; carried by a tool-calls GuidedDecoding (types/guided.py)."""

from __future__ import annotations

import json

import pytest

from sessionserve.types.guided import GuidedDecoding, ToolFormat, tool_format_of

LLAMA31_LIKE = ("{{- bos_token }}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
                "{%- if builtin_tools is defined %}{{- '<|python_tag|>' + tool_call.name }}{%- endif %}")
LLAMA32_LIKE = ("<|start_header_id|>{{ m.role }}<|end_header_id|>{% if 'tool_calls' in m %}"
                "{{ '{\"name\": \"' + m.tool_calls[0].function.name + '\", \"parameters\": ' }}{% endif %}")


@pytest.mark.parametrize(("template", "want"), [
    ("<|im_start|>{{ m.role }}{% for c in m.tool_calls %}<tool_call>\n{{ c | tojson }}</tool_call>{% endfor %}",
     ToolFormat.HERMES),
    # A Hermes fine-tune of Llama writes Hermes blocks under Llama headers.
    ("<|start_header_id|>{{ m.role }}<|end_header_id|>{% if m.tool_calls %}<tool_call>{% endif %}", ToolFormat.HERMES),
    (LLAMA31_LIKE, ToolFormat.LLAMA3_JSON),
    (LLAMA32_LIKE, ToolFormat.LLAMA3_JSON),
    ("[INST]{{ m.content }}[/INST]{% if m.tool_calls %}[TOOL_CALLS] [{{ m.tool_calls | tojson }}]{% endif %}",
     ToolFormat.MISTRAL),
    ("[INST]{{ m.content }}[/INST]{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]"
     "{{ c.function.arguments }}{% endfor %}", ToolFormat.MISTRAL_ARGS),
    # No tools in the template (Llama 3.0, a plain chat template), or no template: the embedded models' format.
    ("<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>", ToolFormat.HERMES),
    ("{{ messages[0].content }}", ToolFormat.HERMES),
    (None, ToolFormat.HERMES),
])
def test_format_of_template(template: str | None, want: ToolFormat) -> None:
    assert tool_format_of(template) is want


def test_tool_calls_carry_the_format() -> None:
    tools = [{"name": "add", "parameters": {"type": "object"}}]
    model_own = GuidedDecoding.tool_calls(tools)
    assert model_own.tool_format() is None and "format" not in model_own.spec_value()
    llama = GuidedDecoding.tool_calls(tools, format=ToolFormat.LLAMA3_JSON)
    assert llama.tool_format() is ToolFormat.LLAMA3_JSON and llama != model_own
    assert llama == GuidedDecoding.tool_calls(tools, format=ToolFormat.LLAMA3_JSON) and hash(llama) == hash(
        GuidedDecoding.tool_calls(tools, format=ToolFormat.LLAMA3_JSON))
    with pytest.raises(ValueError):
        GuidedDecoding.tool_calls(tools, format="llama3_json")  # type: ignore[arg-type]
    spec = {**llama.spec_value(), "format": "pythonic"}
    with pytest.raises(ValueError):
        GuidedDecoding("tool_calls", json.dumps(spec))
    with pytest.raises(ValueError):
        GuidedDecoding.json_object().tool_format()
