"""Tokenizer, chat template and incremental detokenization for a model folder.

Uses the `tokenizers` library on `tokenizer.json` directly and renders the
folder's chat template with jinja2 (sandboxed), the way Hugging Face's
`apply_chat_template` does, without importing transformers at serve time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer


def _tojson(value: Any, indent: int | None = None) -> str:
    # NOTE: jinja2's own tojson escapes <, > and sorts keys; HF templates expect json.dumps.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise(message: str) -> None:
    raise ValueError(message)


class Tokenizer:
    """Encode/decode plus the chat template of one model folder."""

    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir)
        self._tok = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # HF allows [{"name": "default", "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        self.chat_template: str | None = template
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(template) if template else None
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False)) and self.bos_token is not None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render messages (and tools) to the prompt text."""
        if self._template is None:
            raise ValueError("this model has no chat template")
        return self._template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)


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
