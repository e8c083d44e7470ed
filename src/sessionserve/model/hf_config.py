"""Reads a Hugging Face config.json into the few numbers our decoder needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# HF architecture name -> our decoder flavour. The three share one
# implementation (model/decoder.py) and differ only in these flags.
_FLAVOURS: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
}


@dataclass(frozen=True)
class ModelArch:
    """Shape and flavour of a Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def num_params(self) -> int:
        """Parameter count implied by the shapes (tied embeddings counted once)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        per_layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h


def load_arch(model_dir: str | Path) -> ModelArch:
    """Parse `model_dir/config.json` (and generation_config.json for EOS ids)."""
    path = Path(model_dir)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: not a Hugging Face model folder")
    cfg = json.loads(config_path.read_text())
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in _FLAVOURS), None)
    if arch is None:
        raise ValueError(f"unsupported architecture {archs}; supported: {sorted(_FLAVOURS)}")
    flavour = _FLAVOURS[arch]
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    eos = _as_tuple(cfg.get("eos_token_id"))
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        eos = tuple(dict.fromkeys(eos + _as_tuple(json.loads(gen_path.read_text()).get("eos_token_id"))))
    rope_scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
        rope_scaling = None
    return ModelArch(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(cfg.get("rope_theta") or (rope_scaling or {}).get("rope_theta") or 10000.0),
        rope_scaling=rope_scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", flavour["qkv_bias"])) or flavour["qkv_bias"],
        qk_norm=flavour["qk_norm"],
        eos_token_ids=eos,
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
    )


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
