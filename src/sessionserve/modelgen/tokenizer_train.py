"""Train and cache the byte-level BPE tokenizer shared by every embedded model.

The embedded default models (see ``make_model``) need a real tokenizer, but
nothing may be downloaded.  We therefore train a byte-level BPE (GPT-2 family,
Qwen2's exact pre-tokenizer) with the ``tokenizers`` library on text every
machine already has: the Python standard library's own ``*.py`` sources.  Training is deterministic for a given
Python version (sorted file list, fixed sample, no randomness in the trainer),
and the result is cached once under ``<cache_dir>/_tokenizer/tokenizer.json``
so every arch/size shares one vocabulary (a draft model must share its
target's vocab).  ``hf_tokenizer_config`` gives the matching
tokenizer_config.json for a Hugging Face model folder.
"""

from __future__ import annotations

import fcntl
import math
import os
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

VOCAB_SIZE = 16384
# Special (control) tokens: never split, skipped by ``skip_special_tokens``.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Tool-calling markers: atomic added tokens, but ordinary text when decoding
# (as in Qwen2.5), so a decoded completion still shows them to the tool parser.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# special_tokens_map.json: no BOS (prompts start with ChatML markup, as in Qwen).
SPECIAL_TOKENS_MAP: dict[str, Any] = {
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
}

# Qwen2's pre-tokenizer regex (GPT-2's, but digits split one by one and
# case-insensitive contractions); see build_empty_tokenizer for why.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Cap the corpus so training stays well under ~30 s on one core.
DEFAULT_MAX_BYTES = 3_000_000
# Directories whose contents are noisy (test data, codec tables) or vary
# between machines (site-packages) and would make the tokenizer less portable.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings"})
# Below this many bytes the sample is too small for 16k merges to mean anything.
_MIN_CORPUS_BYTES = 500_000


def default_cache_dir() -> Path:
    """Where embedded models and the shared tokenizer are cached."""
    return Path.home() / ".cache" / "sessionserve" / "models"


def tokenizer_cache_path(cache_dir: Path | None = None) -> Path:
    """Path of the cached, shared ``tokenizer.json``."""
    return (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "_tokenizer" / "tokenizer.json"


def _py_files(root: Path) -> list[Path]:
    """Sorted ``*.py`` files under root, skipping noisy/machine-specific dirs."""
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in _SKIP_DIRS for part in rel.parts[:-1]):
            continue
        if path.is_file():
            files.append(path)
    # Sort by the relative path so the order does not depend on the install prefix.
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _sample(files: list[Path], max_bytes: int) -> list[Path]:
    """Evenly strided sample of files totalling about max_bytes.

    Taking the first files alphabetically would train only on a-e modules;
    a stride spreads the sample over the whole library, deterministically.
    """
    sizes = [p.stat().st_size for p in files]
    total = sum(sizes)
    if total <= max_bytes:
        return files
    step = max(1, math.ceil(total / max_bytes))
    chosen: list[Path] = []
    used = 0
    for offset in range(step):  # extra passes only if the first came up short
        for i in range(offset, len(files), step):
            if used >= max_bytes:
                return chosen
            chosen.append(files[i])
            used += sizes[i]
    return chosen


def corpus_files(max_bytes: int = DEFAULT_MAX_BYTES) -> list[Path]:
    """Files of the training corpus: stdlib sources, else installed packages'.

    Raises RuntimeError if neither yields enough text.
    """
    paths = sysconfig.get_paths()
    for key in ("stdlib", "purelib"):
        root = paths.get(key)
        if not root or not Path(root).is_dir():
            continue
        root_path = Path(root)
        # purelib *is* site-packages, so only skip that name for the stdlib.
        files = _py_files(root_path) if key == "stdlib" else _purelib_files(root_path)
        chosen = _sample(files, max_bytes)
        if sum(p.stat().st_size for p in chosen) >= min(_MIN_CORPUS_BYTES, max_bytes):
            return chosen
    raise RuntimeError(
        "cannot train the embedded tokenizer: found no Python sources to train on "
        f"(looked in stdlib={paths.get('stdlib')!r} and purelib={paths.get('purelib')!r}); "
        "provide a model folder instead of the embedded default model"
    )


def _purelib_files(root: Path) -> list[Path]:
    files = [p for p in root.rglob("*.py") if p.is_file() and "__pycache__" not in p.parts]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _texts(files: list[Path]) -> Iterator[str]:
    for path in files:
        # errors="replace": a few stdlib files are latin-1; replacement is deterministic.
        yield path.read_text(encoding="utf-8", errors="replace")


def build_empty_tokenizer() -> Tokenizer:
    """An untrained Qwen2-style byte-level BPE pipeline (NFC, no BOS)."""
    tok = Tokenizer(models.BPE())
    # transformers >= 5 always loads a model_type "qwen2" folder with its own
    # Qwen2Tokenizer, which rebuilds the pipeline as NFC + Qwen2 regex split +
    # ByteLevel (ignoring tokenizer.json's).  Using exactly that pipeline keeps
    # every loader (HF for any arch, raw `tokenizers`, our server) in agreement.
    # It is still a plain byte-level BPE (llama.cpp pre-tokenizer "qwen2").
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def train_tokenizer(
    vocab_size: int = VOCAB_SIZE,
    max_bytes: int = DEFAULT_MAX_BYTES,
    files: list[Path] | None = None,
) -> Tokenizer:
    """Train the byte-level BPE; vocab_size counts the special/tool tokens too."""
    files = corpus_files(max_bytes) if files is None else files
    tok = build_empty_tokenizer()
    n_added = len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_added,
        min_frequency=2,
        show_progress=False,
        # All 256 byte symbols, so any text (any unicode) stays encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_texts(files), trainer=trainer, length=len(files))
    # Added after training so they take the last ids, as in Qwen's vocab.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    if tok.get_vocab_size() > vocab_size:  # cannot happen unless the trainer overshoots
        raise RuntimeError(f"trained vocab {tok.get_vocab_size()} exceeds {vocab_size}")
    return tok


def hf_tokenizer_config(tok: Tokenizer, chat_template: str, max_len: int) -> dict[str, Any]:
    """tokenizer_config.json for a generic PreTrainedTokenizerFast load."""
    decoder = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                 "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "additional_special_tokens": SPECIAL_TOKENS_MAP["additional_special_tokens"],
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        # Byte-level BPE round-trips exactly; HF's space clean-up would break that.
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "model_max_length": max_len,
        "chat_template": chat_template,
    }


def ensure_tokenizer(cache_dir: Path | None = None) -> Path:
    """Return the cached tokenizer.json, training it on first use.

    A file lock keeps concurrent processes from training twice; the JSON is
    written to a temp file and renamed so readers never see a partial file.
    """
    path = tokenizer_cache_path(cache_dir)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():  # another process trained it while we waited
            return path
        tok = train_tokenizer()
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tokenizer-", suffix=".json")
        os.close(fd)
        try:
            tok.save(tmp)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def main() -> None:
    """Time a training run (``python -m sessionserve.modelgen.tokenizer_train``)."""
    start = time.perf_counter()
    files = corpus_files()
    tok = train_tokenizer(files=files)
    size = sum(p.stat().st_size for p in files)
    print(f"trained vocab={tok.get_vocab_size()} on {len(files)} files / {size} bytes "
          f"in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
