"""Tokenizer, chat template and incremental detokenization for a model folder.

Uses the `tokenizers` library on `tokenizer.json` directly and renders the
folder's chat template with jinja2 (sandboxed) in the environment Hugging
Face's `apply_chat_template` gives templates (transformers'
`utils/chat_template_utils.py`), without importing transformers at serve time:
`{% break %}` / `{% continue %}`, `{% generation %}` blocks, `raise_exception`,
`strftime_now`, a `namespace` without underscore attributes, and a `tojson`
that writes JSON as `json.dumps` does (not HTML-escaped) with its `indent`,
`separators`, `sort_keys` and `ensure_ascii`.
Messages reach the template as transformers passes them: keys whose value is
None left out.

The template also says how the model writes tool calls (`tool_format`);
decoding keeps that format's marker tokens even where the tokenizer holds them
as special tokens, so the tool-call parser sees them.
"""

from __future__ import annotations

import functools

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from tokenizers import Tokenizer as _HFTokenizer

from sessionserve.types.guided import ToolFormat, tool_format_of

# Texts at least this long are tokenized without holding the interpreter (see `Tokenizer.encode`).
RELEASE_GIL_CHARS = 4096


class JsonArguments(dict):
    """Tool-call arguments a client sent as JSON text (OpenAI's form), as the template sees them.

    Templates written for transformers read arguments as an object (`| tojson`, `| items`); others
    print or concatenate them as text. This is the parsed object to the first kind and the text as
    sent to the second (`str()`, `+`), and `tojson` without options writes the text as sent: the
    model's own call, when it comes back, renders as the model wrote it.
    """

    __slots__ = ("_text",)

    def __init__(self, value: dict[str, Any], text: str) -> None:
        super().__init__(value)
        self._text = text

    def __str__(self) -> str:
        return self._text

    def __add__(self, other: object) -> str:
        if not isinstance(other, str):
            return NotImplemented
        return self._text + other

    def __radd__(self, other: object) -> str:
        if not isinstance(other, str):
            return NotImplemented
        return other + self._text


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # NOTE: jinja2's own tojson escapes <, > and & for HTML; templates expect json.dumps (as transformers').
    if isinstance(value, JsonArguments) and not ensure_ascii and indent is None and separators is None \
            and not sort_keys:
        return str(value)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(Namespace):
    """`namespace()` refusing underscore-prefixed attributes (as transformers': no path to Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja2's Namespace signature
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        Namespace.__setitem__(self, name, value)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}")


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (marks the assistant's tokens for training): its body as is."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def template_environment() -> ImmutableSandboxedEnvironment:
    """The jinja2 environment chat templates are written for (transformers' `apply_chat_template`)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


def read_chat_template(model_dir: str | Path) -> str | None:
    """The chat template of a model folder: tokenizer_config.json's, else chat_template.jinja; None if neither."""
    path = Path(model_dir)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    template = cfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    if isinstance(template, list):  # HF allows [{"name": "default", "template": ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    return template


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as templates receive them: None values left out (as transformers does), tool-call
    arguments sent as JSON object text given as `JsonArguments`. Copies; the caller's are untouched."""
    out = []
    for message in messages:
        m = {k: v for k, v in message.items() if v is not None}
        if isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = [_template_call(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _template_call(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    fn = call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        return {**call, "function": {**fn, "arguments": _json_arguments(fn["arguments"])}}
    if isinstance(call.get("arguments"), str):  # a bare {"name", "arguments"} call
        return {**call, "arguments": _json_arguments(call["arguments"])}
    return call


def _json_arguments(text: str) -> str | JsonArguments:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return JsonArguments(value, text) if isinstance(value, dict) else text


class Tokenizer:
    """Encode/decode plus the chat template of one model folder."""

    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir)
        self._tok = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = read_chat_template(path)
        self.chat_template: str | None = template
        self._template = template_environment().from_string(template) if template else None
        self.tool_format: ToolFormat = tool_format_of(template)
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        # Further special tokens transformers hands templates (bos / eos always, "" when unset).
        self._template_tokens = {k: t for k in ("unk_token", "pad_token") if (t := _token_text(cfg.get(k)))}
        self._skipped_ids = self._skipped_special_ids()
        self.add_bos = bool(cfg.get("add_bos_token", False)) and self.bos_token is not None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters of text one token stands for (its longest vocabulary entry:
        byte-level entries spell a byte per character, so they are never shorter than their text). A text of
        n characters is at least n / max_token_chars tokens, known without tokenizing it."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # `encode` holds the interpreter while it runs (seconds for megabytes: every other thread, the engine's
        # included, waits); `encode_batch` lets it go, so a long text takes the batch path.
        if len(text) >= RELEASE_GIL_CHARS:
            ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; `skip_special_tokens` leaves out special tokens but the tool-call markers."""
        if skip_special_tokens and self._skipped_ids is not None:
            return self._tok.decode([i for i in ids if i not in self._skipped_ids], skip_special_tokens=False)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render messages (and tools) to the prompt text, as transformers' `apply_chat_template(...,
        tokenize=False)` does; template errors raise (jinja2's TemplateError for `raise_exception`)."""
        if self._template is None:
            raise ValueError("this model has no chat template")
        context = {"documents": None, **self._template_tokens, "bos_token": self.bos_token or "",
                   "eos_token": self.eos_token or "", **kwargs}
        return self._template.render(messages=_template_messages(messages), tools=tools,
                                     add_generation_prompt=add_generation_prompt, **context)

    def _skipped_special_ids(self) -> frozenset[int] | None:
        """Special token ids decoding skips when the tool format's markers are special too (else None:
        the tokenizer's own skipping keeps them)."""
        special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        markers = {self._tok.token_to_id(m) for m in self.tool_format.markers} & special
        return frozenset(special - markers) if markers else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back partial UTF-8 and stop-string prefixes.

    Decodes a short window of recent tokens each time (as vLLM does), so the
    cost per token does not grow with the output length.
    """

    tokenizer: Tokenizer
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    text: str = ""  # all text produced so far (up to a matched stop string)
    _prefix_offset: int = 0
    _read_offset: int = 0
    _emitted: int = 0  # chars of `text` already returned as deltas
    stopped_by: str | None = None
    _ids: list[int] = field(default_factory=list)

    def add(self, new_ids: list[int], finished: bool = False) -> str:
        """Feed new tokens; return the text that is now safe to show."""
        ids = self._ids
        ids.extend(new_ids)
        prefix = self.tokenizer.decode(ids[self._prefix_offset:self._read_offset])
        full = self.tokenizer.decode(ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
        elif finished and len(full) > len(prefix):
            self.text += full[len(prefix):]
        if self.stop and self.stopped_by is None:
            self._find_stop()
        # Hold back a tail that could still become a stop string.
        hold = 0 if (finished or self.stopped_by is not None) else _longest_stop_prefix(self.text, self.stop)
        end = len(self.text) - hold
        delta = self.text[self._emitted:end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return delta

    def _find_stop(self) -> None:
        # Only the new tail can contain a stop string that was not there before.
        window = max(len(s) for s in self.stop) + 16
        start = max(0, self._emitted - window)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.stopped_by = s
            self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]


def _longest_stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
