"""Messages to prompt tokens with the model's chat template, and the text that continues a session.

A session holds the tokens of its conversation so far, the model's own
replies among them exactly as they were generated. A turn that extends the
conversation needs only the text that follows the last reply: the template's
closing of that reply (e.g. the newline after `<|im_end|>`), the new messages
(tool results, the next user message) and the generation prompt. That text is
found by rendering the conversation with and without the new messages and
taking the difference; it is cut right after the special token the reply
stopped on, where tokenization starts afresh, so its tokens join the
session's exactly. Only that text is tokenized and prefilled.
"""

from __future__ import annotations

from typing import Any

from sessionserve.model.tokenizer import Tokenizer


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the chat template reads them (developer is a system turn; copies, never the caller's)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "developer":
            m["role"] = "system"
        if m.get("tool_calls"):
            m["tool_calls"] = [dict(tc) for tc in m["tool_calls"]]
        out.append(m)
    return out


def render_text(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool = True) -> str:
    # NOTE: tools in OpenAI's wrapped form ({"type": "function", "function": {...}}), as transformers and
    # vLLM hand them to templates: published templates read `tool.function`.
    return tokenizer.apply_chat_template(template_messages(messages), tools=tools or None,
                                         add_generation_prompt=add_generation_prompt)


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """The prompt tokens of a whole conversation, ending with the assistant header."""
    return tokenizer.encode(render_text(tokenizer, messages, tools), add_special_tokens=False)


def continuation_text(tokenizer: Tokenizer, held: list[dict[str, Any]], new: list[dict[str, Any]],
                      tools: list[dict[str, Any]] | None, stop_text: str, stopped: bool = True) -> str | None:
    """The text that follows a session holding `held` (whose last message is the model's reply) when `new`
    messages are added. The template closes the reply with the special token `stop_text`; `stopped`: the
    session's tokens end with it (the reply stopped on it), else the reply was cut before it and the text
    starts with it. None if the template does not render `held` as the start of `held + new`, or does not
    close the reply with `stop_text`."""
    before = render_text(tokenizer, held, tools, add_generation_prompt=False)
    after = render_text(tokenizer, held + new, tools, add_generation_prompt=True)
    if not after.startswith(before):
        return None
    at = before.rfind(stop_text)
    if at < 0 or before[at + len(stop_text):].strip():  # the reply must be the last thing `before` closes
        return None
    return before[at + len(stop_text) if stopped else at:] + after[len(before):]
