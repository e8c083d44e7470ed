"""Structured outputs on the model side: compile `GuidedDecoding` constraints with xgrammar and mask logits.

`GrammarCompiler` builds xgrammar's view of the tokenizer straight from
`tokenizer.json` (no transformers at serve time) and compiles constraints,
cached by spec. A `Constraint` is one request's grammar state; each step
`apply_constraints` fills one token bitmask for the constrained rows of the
batch and applies it to the logits in place (a C++ fill per row, a vectorised
apply for the batch: no Python loop over the vocabulary).

Tool calls are written in the model's format (`ToolFormat`, from its chat
template, unless the constraint names one), arguments as compact JSON:

    hermes        <tool_call>\\n{"name": "<NAME>", "arguments": <ARGS>}\\n</tool_call>, "\\n" between calls
    llama3_json   {"name": "<NAME>", "parameters": <ARGS>}, "; " between calls
    mistral       [TOOL_CALLS] [{"name": "<NAME>", "arguments": <ARGS>}, ...]
    mistral_args  [TOOL_CALLS]<NAME>[ARGS]<ARGS> per call

Markers are matched as their dedicated tokens where the tokenizer has them
(special tokens included), never as other spellings of their text.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import xgrammar as xgr
from tokenizers import Tokenizer as _HFTokenizer

from sessionserve.model.hf_config import load_arch
from sessionserve.model.tokenizer import read_chat_template
from sessionserve.types.guided import GuidedDecoding, ToolFormat, tool_format_of

if TYPE_CHECKING:
    from sessionserve.model.grammar_worker import GrammarWorker

logger = logging.getLogger(__name__)

TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
# Markers that open or close a call: kept out of JSON strings (parsers look for them there).
_GUARDED_MARKERS = (TOOL_CALL_BEGIN, TOOL_CALL_END, MISTRAL_TOOL_CALLS)
# Markers the grammars emit: grammar text even where the tokenizer marks them special.
_GRAMMAR_MARKERS = (*_GUARDED_MARKERS, MISTRAL_ARGS)
_CACHE_MAX_ENTRIES = 256
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


class GrammarCompiler:
    """xgrammar tokenizer info and compiler for one model folder, with a cache of compiled grammars."""

    def __init__(self, model_dir: str | Path, stop_token_ids: tuple[int, ...] | None = None,
                 max_threads: int = 8) -> None:
        path = Path(model_dir)
        self.model_dir = path
        self._stop_token_ids = stop_token_ids
        self._worker: GrammarWorker | None = None
        self._background: ThreadPoolExecutor | None = None  # compiles what the worker passed (see use_worker)
        arch = load_arch(path)
        tokenizer_json = (path / "tokenizer.json").read_text()
        self._tok = _HFTokenizer.from_str(tokenizer_json)
        # The mask must cover the model's logits, which may be wider than the tokenizer.
        self.vocab_size = arch.vocab_size
        self.tool_format = tool_format_of(read_chat_template(path))
        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        special -= set(_GRAMMAR_MARKERS)
        encoded = [""] * self.vocab_size
        for token, token_id in self._tok.get_vocab(with_added_tokens=True).items():
            if token_id < self.vocab_size:
                # An empty string makes xgrammar treat the id as special: never grammar text
                # (`<|im_start|>` must not appear spelled inside a JSON string). Stop ids stay usable.
                encoded[token_id] = "" if token in special else token
        stops = list(stop_token_ids or arch.eos_token_ids or self._eos_from_config(path))
        if not stops:
            raise ValueError(f"{path}: no EOS token ids; structured outputs need one to end")
        vocab_type, add_prefix_space = _detect_vocab_type(tokenizer_json)
        self.tokenizer_info = xgr.TokenizerInfo(encoded, vocab_type, vocab_size=self.vocab_size,
                                                stop_token_ids=stops, add_prefix_space=add_prefix_space)
        self.stop_token_ids = tuple(self.tokenizer_info.stop_token_ids)
        self._compiler = self._xgr_compiler(max_threads)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._failed: OrderedDict[tuple[str, str], str] = OrderedDict()  # spec -> why it did not compile
        self._lock = threading.Lock()
        self._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.marker_token_ids = tuple(i for i in map(self._single_token, _GUARDED_MARKERS) if i is not None)

    def compile(self, guided: GuidedDecoding) -> xgr.CompiledGrammar:
        """The compiled grammar for `guided` (cached). Raises ValueError for a spec xgrammar rejects, one
        nested too deeply, or (with a worker, see `use_worker`) one that takes too long to compile."""
        key = (guided.kind, guided.spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            failed = self._failed.get(key)
        if failed is not None:  # a spec that failed (or took too long) once fails at once again
            raise ValueError(failed)
        if self._worker is not None:
            try:
                self._worker.check(guided)  # in a child first: it can be stopped
            except ValueError as exc:
                with self._lock:
                    self._failed[key] = str(exc)
                    if len(self._failed) > _CACHE_MAX_ENTRIES:
                        self._failed.popitem(last=False)
                raise
            assert self._background is not None
            compiled = self._background.submit(self.compile_uncached, guided).result()
        else:
            compiled = self.compile_uncached(guided)
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > _CACHE_MAX_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def use_worker(self, timeout_s: float) -> None:
        """Try cache misses in a child process first, stopped past `timeout_s`; compile those that pass on a
        thread below the server's priority (see model/grammar_worker.py)."""
        from sessionserve.model.grammar_worker import GrammarWorker, lower_thread_priority

        if self._worker is None:
            self._worker = GrammarWorker(self.model_dir, self._stop_token_ids, timeout_s)
            # One compiler thread, the calling one: xgrammar's own would run at the server's priority.
            self._compiler = self._xgr_compiler(1)
            self._background = ThreadPoolExecutor(self._worker.num_children, thread_name_prefix="grammar",
                                                  initializer=lower_thread_priority)
        self._worker.timeout_s = timeout_s

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._background is not None:
            self._background.shutdown(wait=False, cancel_futures=True)

    def constraint(self, guided: GuidedDecoding, stop_token_ids: tuple[int, ...] = ()) -> Constraint:
        """A fresh per-request matcher; `stop_token_ids` (a request's own) end the output too, besides EOS."""
        return Constraint(self, self.compile(guided), stop_token_ids, marker_ids=self.marker_token_ids)

    def bitmask(self, num_rows: int) -> torch.Tensor:
        """A reusable (num_rows, ceil(vocab / 32)) int32 CPU bitmask; rows are overwritten by fills."""
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 2 * self._bitmask.shape[0]), self.vocab_size)
        return self._bitmask[:num_rows]

    def _xgr_compiler(self, max_threads: int) -> xgr.GrammarCompiler:
        # Without xgrammar's own cache (unbounded by default): `compile` keeps a bounded one.
        return xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)

    def compile_uncached(self, guided: GuidedDecoding) -> xgr.CompiledGrammar:
        """Compile `guided` now, remembering nothing (a compiler child's check); ValueError for a bad spec."""
        try:
            return self._compile(guided)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar reports bad specs as these
            raise ValueError(f"cannot compile {guided.kind} constraint: {exc}") from None
        except RecursionError:
            raise ValueError(f"cannot compile {guided.kind} constraint: it is nested too deeply") from None

    def _compile(self, guided: GuidedDecoding) -> xgr.CompiledGrammar:
        if guided.kind == "json_object":
            return self._compiler.compile_grammar(_json_ebnf({"type": "object"}, strict=False))
        if guided.kind == "json_schema":
            return self._compiler.compile_grammar(_json_ebnf(guided.spec))
        if guided.kind == "regex":
            return self._compiler.compile_regex(guided.spec)
        if guided.kind == "tool_calls":
            return self._compiler.compile_structural_tag(json.dumps(self.tool_calls_structural_tag(guided)))
        raise ValueError(f"unknown guided decoding kind {guided.kind!r}")

    def tool_calls_structural_tag(self, guided: GuidedDecoding) -> dict[str, Any]:
        """xgrammar structural tag for `guided` (kind tool_calls): one or more calls in the tool format."""
        parallel = bool(guided.spec_value()["parallel"])
        tools = guided.allowed_tools()
        # EBNF, not the structural tag's json_schema format: that one allows free whitespace.
        args = {t["name"]: {"type": "grammar", "grammar": _json_ebnf(t["parameters"])} for t in tools}
        tool_format = guided.tool_format() or self.tool_format
        if tool_format is ToolFormat.HERMES:
            tags = [{"type": "tag", "begin": self._marker(TOOL_CALL_BEGIN),
                     "content": {"type": "sequence", "elements": [
                         _const('\n{"name": ' + _json_text(name) + ', "arguments": '), grammar, _const("}\n")]},
                     "end": self._marker(TOOL_CALL_END)} for name, grammar in args.items()]
            calls = _separated(tags, "\n", parallel)
        elif tool_format is ToolFormat.LLAMA3_JSON:
            calls = _separated([_call_object(name, "parameters", grammar) for name, grammar in args.items()],
                               "; ", parallel)
        elif tool_format is ToolFormat.MISTRAL:
            objects = _separated([_call_object(name, "arguments", grammar) for name, grammar in args.items()],
                                 ", ", parallel)
            calls = {"type": "sequence", "elements": [self._marker_format(MISTRAL_TOOL_CALLS), _const(" ["),
                                                      objects, _const("]")]}
        else:
            assert tool_format is ToolFormat.MISTRAL_ARGS
            one = [{"type": "sequence", "elements": [self._marker_format(MISTRAL_TOOL_CALLS), _const(name),
                                                     self._marker_format(MISTRAL_ARGS), grammar]}
                   for name, grammar in args.items()]
            calls = one[0] if len(one) == 1 else {"type": "or", "elements": one}
            if parallel:
                calls = {"type": "plus", "content": calls}
        answer = guided.answer()
        if answer is not None:  # tools and a response format: the calls, or an answer of that shape
            schema = {"type": "object"} if answer.kind == "json_object" else answer.spec
            calls = {"type": "or", "elements": [
                calls, {"type": "grammar", "grammar": _json_ebnf(schema, strict=answer.kind == "json_schema")}]}
        return {"type": "structural_tag", "format": calls}

    def _single_token(self, text: str) -> int | None:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ids[0] if len(ids) == 1 and self._tok.id_to_token(ids[0]) == text else None

    def _marker(self, text: str) -> str | dict[str, Any]:
        # Match the marker as the one token the model emits (and parsers may look for by id),
        # not as any spelling of its text; fall back to text when it is not a single token.
        token_id = self._single_token(text)
        return text if token_id is None else {"type": "token", "token": token_id}

    def _marker_format(self, text: str) -> dict[str, Any]:
        """The marker as an element of a sequence."""
        marker = self._marker(text)
        return _const(marker) if isinstance(marker, str) else marker

    def _eos_from_config(self, path: Path) -> tuple[int, ...]:
        cfg_path = path / "tokenizer_config.json"
        if not cfg_path.is_file():
            return ()
        eos = json.loads(cfg_path.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        token_id = self._tok.token_to_id(eos) if isinstance(eos, str) else None
        return () if token_id is None else (token_id,)


class Constraint:
    """One request's position in its grammar: fills its mask row, advances on each sampled token."""

    __slots__ = ("compiler", "marker_ids", "num_seen_tokens", "_matcher", "_stop_ids")

    def __init__(self, compiler: GrammarCompiler, compiled: xgr.CompiledGrammar,
                 stop_token_ids: tuple[int, ...] = (), marker_ids: tuple[int, ...] = ()) -> None:
        self.compiler = compiler
        # Tool-call marker tokens, allowed only where the grammar wants no other text (see apply_constraints).
        self.marker_ids = marker_ids
        override = sorted(set(compiler.stop_token_ids) | set(stop_token_ids)) if stop_token_ids else None
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=override)
        self._stop_ids = tuple(override or compiler.stop_token_ids)
        # Output tokens offered to `accept` (accepted or not): kept equal to the sequence's
        # output length, so a missed token can be detected and replayed (`sync`).
        self.num_seen_tokens = 0

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: only stop tokens may follow."""
        return bool(self._matcher.is_terminated())

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into `bitmask[row]`; False when every token is allowed."""
        if self._matcher.is_terminated():
            # xgrammar refuses to fill after its stop token (e.g. ignore_eos kept going): stops only.
            bitmask[row].zero_()
            for token_id in self._stop_ids:
                word, bit = divmod(token_id, 32)
                bitmask[row, word] |= _int32_bit(bit)
            return True
        return bool(self._matcher.fill_next_token_bitmask(bitmask, row))

    def accept(self, token_id: int) -> bool:
        """Advance past the sampled token; False (and a warning) if the grammar does not allow it."""
        self.num_seen_tokens += 1
        if self._matcher.is_terminated():
            return token_id in self._stop_ids
        ok = bool(self._matcher.accept_token(token_id))
        if not ok:
            logger.warning("structured output: token %d is outside the grammar; constraint state kept", token_id)
        return ok

    def sync(self, output_token_ids: list[int]) -> None:
        """Accept output tokens this constraint has not seen (e.g. ones appended without `accept`)."""
        for token_id in output_token_ids[self.num_seen_tokens:]:
            self.accept(token_id)


def apply_constraints(logits: torch.Tensor, constraints: list[Constraint | None]) -> None:
    """Mask `logits` (S, V) in place: row i keeps only the tokens `constraints[i]` allows (None: untouched)."""
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return
    compiler = constraints[rows[0]].compiler  # type: ignore[union-attr]
    bitmask = compiler.bitmask(len(constraints))
    masked = [i for i in rows if constraints[i].fill_mask(bitmask, i)]  # type: ignore[union-attr]
    if not masked:
        return
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for i in masked:
        c = constraints[i]
        assert c is not None
        if c.marker_ids:
            groups.setdefault((c.marker_ids, c._stop_ids), []).append(i)
    for (marker_ids, stop_ids), group in groups.items():
        _markers_only_alone(bitmask, group, marker_ids, stop_ids)
    vocab_size = min(logits.shape[-1], compiler.vocab_size)
    if logits.device.type == "cpu":
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=masked)
        return
    device_mask = bitmask.to(logits.device)
    try:
        xgr.apply_token_bitmask_inplace(logits, device_mask, vocab_size=vocab_size, indices=masked)
    except ImportError:  # no triton on this install: xgrammar's plain-torch kernel
        xgr.apply_token_bitmask_inplace(logits, device_mask, vocab_size=vocab_size, indices=masked,
                                        backend="torch_native")


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _json_text(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def _call_object(name: str, key: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """`{"name": <name>, "<key>": <arguments>}` as a tag: the name and key fixed, then the arguments grammar."""
    return {"type": "tag", "begin": '{"name": ' + _json_text(name) + f', "{key}": ', "content": arguments,
            "end": "}"}


def _separated(tags: list[dict[str, Any]], separator: str, parallel: bool) -> dict[str, Any]:
    """One of `tags`, or (parallel) one or more separated by `separator`."""
    return {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True,
            "stop_after_first": not parallel}


def _json_ebnf(schema: dict[str, Any] | str, strict: bool = True) -> str:
    """EBNF for JSON matching `schema`, with compact separators (", ", ": ") as json.dumps writes.

    Compact, not free whitespace: it matches the chat template's tojson, and a weak
    model cannot pad without end. `strict`: no properties beyond those declared.
    """
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict))
    # xgrammar 0.2.9 lets the characters of min/maxLength strings be raw control characters
    # (tab, \x01...), which JSON forbids (json.loads rejects them): exclude them as its
    # unbounded strings do.
    return ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


def _markers_only_alone(bitmask: torch.Tensor, rows: list[int], marker_ids: tuple[int, ...],
                        stop_ids: tuple[int, ...]) -> None:
    """Clear the marker tokens' bits in `rows` that allow other text tokens too.

    Markers such as `<tool_call>` are ordinary text to xgrammar, so a JSON string may
    contain them, which would break parsers that split on them. The tool-call grammars
    want a marker only where it is the sole text token (a call's begin at the start or
    after the separator, or after a call where the output may also end; the end right
    after the arguments), so a row that allows a marker among other text tokens is
    inside a string (or a grammar that has no markers at all).
    """
    index = torch.tensor(rows, dtype=torch.long)
    others = bitmask[index]  # (k, W) copy
    for token_id in (*marker_ids, *stop_ids):
        word, bit = divmod(token_id, 32)
        others[:, word] &= ~_int32_bit(bit)
    inside = index[others.any(dim=1)]
    if len(inside):
        for token_id in marker_ids:
            word, bit = divmod(token_id, 32)
            bitmask[inside, word] &= ~_int32_bit(bit)


def _int32_bit(bit: int) -> int:
    # Bit 31 of an int32 word is its sign bit.
    return (1 << bit) - (1 << 32 if bit == 31 else 0)


def _detect_vocab_type(tokenizer_json: str) -> tuple[xgr.VocabType, bool]:
    """(vocab type, add_prefix_space) of a tokenizer.json, as xgrammar's HF loader detects them."""
    try:
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)
        return meta["vocab_type"], bool(meta["add_prefix_space"])
    except Exception:  # private xgrammar helper: fall back to what our byte-level BPE needs
        logger.warning("xgrammar could not detect the vocab type; assuming byte-level BPE")
        return xgr.VocabType.BYTE_LEVEL, False
