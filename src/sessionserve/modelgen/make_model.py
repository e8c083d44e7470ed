"""Build the embedded default model: a Hugging Face model folder with random weights.

``make_model`` writes an ordinary HF folder (config.json, model.safetensors,
tokenizer files with a ChatML/tool-calling chat template, generation_config.json)
for a real architecture (Llama, Qwen2, Qwen3), so the server runs end to end
with no downloads.  Only torch, safetensors and tokenizers are used here -- not
transformers -- so the folder is an independent check of any loader.
``make-model --train`` writes the same folder with trained weights (``train.py``).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from sessionserve.modelgen.tokenizer_train import (
    SPECIAL_TOKENS_MAP,
    VOCAB_SIZE,
    default_cache_dir,
    ensure_tokenizer,
    hf_tokenizer_config,
)

ARCHS = ("llama", "qwen2", "qwen3")
SIZES = ("tiny", "small")

_SHAPES: dict[str, dict[str, int]] = {
    # tiny: a few M params, for tests.  small: ~120M, for benchmarks.
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=384, max_position_embeddings=4096),
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=3072, max_position_embeddings=8192),
}
# Llama-3 rope scaling's pre-extension context, so HF's "llama3" rope path is exercised.
_LLAMA3_ORIGINAL_MAX = {"tiny": 1024, "small": 2048}
_ARCH_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _check(arch: str, size: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")


def model_config(arch: str, size: str, eos_token_id: int, pad_token_id: int) -> dict[str, Any]:
    """The config.json contents, with exact HF field names."""
    _check(arch, size)
    return shape_config(arch, _SHAPES[size], eos_token_id, pad_token_id, _LLAMA3_ORIGINAL_MAX[size])


def shape_config(arch: str, shape: dict[str, int], eos_token_id: int, pad_token_id: int,
                 llama3_original_max: int = 1024) -> dict[str, Any]:
    """config.json for any shape (hidden_size, num_hidden_layers, heads, kv heads,
    intermediate_size, max_position_embeddings; head_dim defaults to hidden/heads)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    cfg: dict[str, Any] = {
        "architectures": [_ARCH_CLASS[arch]],
        "model_type": arch,
        "vocab_size": VOCAB_SIZE,
        **{k: v for k, v in shape.items() if k != "head_dim"},
        "head_dim": shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"]),
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": "float32",
        # No BOS: prompts start straight with the ChatML markup, as in Qwen.
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }
    if arch == "llama":
        cfg.update(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": llama3_original_max,
            },
            attention_bias=False,
            mlp_bias=False,
            pretraining_tp=1,
            tie_word_embeddings=False,
        )
    else:
        cfg.update(
            rope_theta=1000000.0,
            rope_scaling=None,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=shape["num_hidden_layers"],
            tie_word_embeddings=True,
        )
        if arch == "qwen3":
            cfg["attention_bias"] = False
    return cfg


def weight_shapes(arch: str, cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, in a fixed order (the order weights are drawn)."""
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_dim, kv_dim = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_dim, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_dim, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_dim, h)
        if arch == "qwen2":  # HF Qwen2 hard-codes bias on q/k/v only
            shapes[p + "self_attn.q_proj.bias"] = (q_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_dim,)
        if arch == "qwen3":  # per-head RMSNorm on q and k
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_dim)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def param_count(arch: str, size: str) -> int:
    """Parameter count of arch/size, computed from the config without building it."""
    cfg = model_config(arch, size, eos_token_id=0, pad_token_id=0)
    return sum(math.prod(s) for s in weight_shapes(arch, cfg).values())


# Target logit standard deviation over the vocab: peaked enough that greedy
# decoding is not a coin toss between near-equal tokens.
_LOGIT_STD = 3.0
# Input embedding norm (per-element std * sqrt(hidden)); small next to the
# residual stream so tied output embeddings do not just echo the input token.
_EMBED_NORM = 0.5


def init_weights(arch: str, cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random weights; same seed -> bit-identical tensors (on the same machine).

    A GPT-style std of 0.02 everywhere makes a random model degenerate: layer
    outputs are tiny next to the embedding, so the last hidden state is just
    the input token and (with tied embeddings) greedy decoding repeats it
    forever.  Instead every projection gets std 1/sqrt(fan_in) (variance
    preserving) so layers really mix context and dominate the residual, the
    input embedding is kept small, and the logit scale comes from lm_head or,
    when tied, from the final norm's gain.
    """
    gen = torch.Generator().manual_seed(seed)
    h = cfg["hidden_size"]
    tied = cfg["tie_word_embeddings"]
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(arch, cfg).items():
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name == "model.norm.weight":
            gain = _LOGIT_STD / _EMBED_NORM if tied else 1.0
            t = gain * (1.0 + 0.1 * noise)
        elif name.endswith("norm.weight"):
            # Not exactly 1.0, so a skipped or misapplied norm changes outputs.
            t = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            # Large enough that a dropped bias fails equality tests.
            t = 0.1 * noise
        elif name == "model.embed_tokens.weight":
            t = noise * (_EMBED_NORM / math.sqrt(h))
        elif name == "lm_head.weight":
            t = noise * (_LOGIT_STD / math.sqrt(h))
        else:
            t = noise / math.sqrt(shape[1])
        tensors[name] = t.contiguous()
    return tensors


def read_chat_template() -> str:
    """The packaged ChatML/tool-calling template (chat_template.jinja)."""
    return resources.files("sessionserve.modelgen").joinpath("chat_template.jinja").read_text(encoding="utf-8")


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _fsync_tree(folder: Path) -> None:
    # Rename is atomic only for what has reached the disk; flush files first.
    for path in folder.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def make_model(
    out_dir: str | Path,
    arch: str = "llama",
    size: str = "small",
    seed: int = 0,
    *,
    cache_dir: Path | None = None,
    context: int | None = None,
) -> Path:
    """Write a complete HF model folder to out_dir (replacing it) and return it.

    cache_dir locates the shared tokenizer cache (default
    ``~/.cache/sessionserve/models``). `context`: max_position_embeddings instead of the size's own
    (agent clients such as Claude Code open with 20-30k tokens of system prompt and tools).
    """
    _check(arch, size)
    if context is not None and context < 2:
        raise ValueError("context must be >= 2 tokens")
    tok_path = ensure_tokenizer(cache_dir)
    eos, pad = special_token_ids(tok_path)
    cfg = model_config(arch, size, eos_token_id=eos, pad_token_id=pad)
    if context is not None:
        cfg["max_position_embeddings"] = context
    return write_model_folder(out_dir, cfg, lambda: init_weights(arch, cfg, seed), tok_path)


def special_token_ids(tok_path: Path) -> tuple[int, int]:
    """(eos, pad) ids of the tokenizer at tok_path: ``<|im_end|>`` and ``<|endoftext|>``."""
    tok = Tokenizer.from_file(str(tok_path))
    return tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")


def write_model_folder(
    out_dir: str | Path,
    cfg: dict[str, Any],
    weights: Callable[[], dict[str, torch.Tensor]],
    tok_path: Path,
    extra_json: dict[str, Any] | None = None,
) -> Path:
    """Write config, weights (HF names), tokenizer files and generation_config to out_dir.

    Every embedded model, random or trained, goes through here, so they share
    the tokenizer, chat template and generation settings byte for byte.
    ``extra_json`` maps file names to objects written beside them.  The folder
    is built in a temp dir beside out_dir and renamed into place, so a crash
    never leaves a half-written model.
    """
    out = Path(out_dir).absolute()
    tok = Tokenizer.from_file(str(tok_path))
    eos, pad = special_token_ids(tok_path)
    chat_template = read_chat_template()

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_json(tmp / "config.json", cfg)
        # Metadata "format": "pt" is what HF loaders require of a safetensors file.
        save_file(weights(), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        shutil.copyfile(tok_path, tmp / "tokenizer.json")
        _write_json(tmp / "tokenizer_config.json",
                    hf_tokenizer_config(tok, chat_template, cfg["max_position_embeddings"]))
        _write_json(tmp / "special_tokens_map.json", SPECIAL_TOKENS_MAP)
        _write_json(tmp / "generation_config.json", {
            "bos_token_id": None,
            "eos_token_id": [eos, pad],
            "pad_token_id": pad,
            "do_sample": False,
        })
        for name, obj in (extra_json or {}).items():
            _write_json(tmp / name, obj)
        _fsync_tree(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        if out.exists():
            # A directory cannot be renamed over a non-empty one: move the old aside first.
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / out.name)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def default_model_dir(arch: str = "llama", size: str = "small", cache_dir: Path | None = None) -> Path:
    """Where ensure_model keeps arch/size: ``<cache_dir>/<arch>-<size>``."""
    _check(arch, size)
    return (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / f"{arch}-{size}"


def ensure_model(arch: str = "llama", size: str = "small", cache_dir: Path | None = None) -> Path:
    """Return the default model dir for arch/size, building it on first use.

    An fcntl lock serialises builders, so concurrent servers build it once.
    """
    out = default_model_dir(arch, size, cache_dir)
    if (out / "config.json").is_file():  # the rename is atomic: present means complete
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").is_file():
            return out
        # Leftovers of a builder that crashed while holding this lock.
        for stale in out.parent.glob(f".{out.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        return make_model(out, arch, size, cache_dir=cache_dir)


def main(argv: list[str] | None = None) -> None:
    """CLI: ``sessionserve make-model [--arch A] [--size S] [--seed N] [--out DIR]``, or with
    ``--train [--pair] [--train-steps N] [--train-minutes M]`` trained weights (see ``model/train.py``; for
    ``--distill`` and ``--distill-from``, ``model/distill.py``)."""
    parser = argparse.ArgumentParser(prog="sessionserve make-model", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--size", choices=SIZES, default=None, help="random-weight size (default small)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: the shared cache, built only if missing)")
    parser.add_argument("--context", type=int, default=None,
                        help="context length in tokens (max_position_embeddings; default: the size's, 8192 for "
                             "small). Claude Code's first request is 20-30k tokens: use 65536 for it")
    parser.add_argument("--cache-dir", type=Path, default=None)
    train = parser.add_argument_group("trained weights (needs transformers)")
    train.add_argument("--train", action="store_true",
                       help="train on the Python standard library's sources instead of random weights "
                            "(default out: <cache>/trained-<shape>)")
    train.add_argument("--pair", action="store_true",
                       help="train a target and a smaller draft with the same tokenizer, into OUT/target and "
                            "OUT/draft (default <cache>/trained-target and <cache>/trained-draft)")
    train.add_argument("--train-shape", choices=("target", "draft", "large", "xl", "mini", "tiny"), default="target",
                       help="the one shape trained without --pair")
    train.add_argument("--train-steps", type=int, default=None,
                       help="optimizer steps per model (default: train.DEFAULT_NUM_STEPS)")
    train.add_argument("--train-minutes", type=float, default=None,
                       help="extra wall-clock cap per model; a run it cuts short is not reproducible")
    train.add_argument("--distill", action="store_true",
                       help="with --pair: distill the draft from the trained target (its next-token "
                            "distributions, on corpus text and on the target's own greedy continuations)")
    train.add_argument("--distill-from", type=Path, default=None, metavar="TARGET",
                       help="distill one model (--train-shape, default draft) from the model folder TARGET")
    args = parser.parse_args(argv)
    if args.distill_from is not None:
        args.train = True
        if args.pair:
            parser.error("--distill-from trains one draft; use --pair --distill to train both")
    if args.distill and not args.pair:
        parser.error("--distill needs --pair (or use --distill-from TARGET)")
    if args.train:
        if args.size is not None:
            parser.error("--size is for random weights; trained shapes are --train-shape or --pair")
        _train_main(args)
        return
    if args.pair or args.train_steps is not None or args.train_minutes is not None:
        parser.error("--pair, --train-steps and --train-minutes need --train")
    size = args.size or "small"
    if args.out is None:
        if args.seed != 0 or args.context is not None:
            parser.error("--seed and --context need --out (the cached default model is fixed)")
        path = ensure_model(args.arch, size, args.cache_dir)
    else:
        path = make_model(args.out, args.arch, size, args.seed, cache_dir=args.cache_dir, context=args.context)
    print(path)


def _train_main(args: argparse.Namespace) -> None:
    from sessionserve.modelgen import train as tr
    from sessionserve.modelgen.distill import distill_model

    cfg = tr.TrainConfig(
        num_steps=args.train_steps if args.train_steps is not None else tr.DEFAULT_NUM_STEPS,
        seed=args.seed,
        max_train_s=None if args.train_minutes is None else 60.0 * args.train_minutes,
    )
    if args.pair:
        results = tr.train_pair(args.out, cfg, arch=args.arch, cache_dir=args.cache_dir, distill=args.distill)
    elif args.distill_from is not None:
        shape = args.train_shape if args.train_shape != "target" else "draft"
        out = args.out if args.out is not None else tr.default_trained_dir(shape, args.cache_dir)
        results = (distill_model(out, args.distill_from, tr.SHAPES[shape], cfg, arch=args.arch, role=shape,
                                 cache_dir=args.cache_dir),)
    else:
        out = args.out if args.out is not None else tr.default_trained_dir(args.train_shape, args.cache_dir)
        results = (tr.train_model(out, tr.SHAPES[args.train_shape], cfg, arch=args.arch, role=args.train_shape,
                                  cache_dir=args.cache_dir),)
    for result in results:
        print(tr.summary(result))


if __name__ == "__main__":
    main()
