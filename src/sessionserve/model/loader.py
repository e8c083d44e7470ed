"""Loads Hugging Face safetensors weights by name into `DecoderModel`, fusing projections."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from sessionserve.model.decoder import DecoderModel
from sessionserve.model.hf_config import ModelArch

# HF name suffix -> (our fused parameter, shard index within it).
_FUSED = {
    "self_attn.q_proj": ("qkv_proj", 0),
    "self_attn.k_proj": ("qkv_proj", 1),
    "self_attn.v_proj": ("qkv_proj", 2),
    "mlp.gate_proj": ("gate_up_proj", 0),
    "mlp.up_proj": ("gate_up_proj", 1),
}
_RENAMED = {
    "self_attn.o_proj": "o_proj",
    "mlp.down_proj": "down_proj",
    "self_attn.q_norm": "q_norm",
    "self_attn.k_norm": "k_norm",
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
}


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def load_weights(model: DecoderModel, model_dir: str | Path) -> None:
    """Copy every tensor of the checkpoint into `model`. Raises on missing or unexpected names."""
    arch: ModelArch = model.arch
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shard_sizes = {"qkv_proj": (q, kv, kv), "gate_up_proj": (arch.intermediate_size, arch.intermediate_size)}
    unexpected: list[str] = []
    with torch.no_grad():
        for path in _weight_files(Path(model_dir)):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    target = _target(name, shard_sizes)
                    if target is None:
                        if "rotary_emb.inv_freq" not in name:
                            unexpected.append(name)
                        continue
                    our_name, offset, size = target
                    if our_name not in params:
                        unexpected.append(name)
                        continue
                    tensor = f.get_tensor(name)
                    dest = params[our_name]
                    if offset is None:
                        if dest.shape != tensor.shape:
                            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dest.shape)}")
                        dest.copy_(tensor)
                        loaded.add(our_name)
                    else:
                        dest.narrow(0, offset, size).copy_(tensor)
                        loaded.add(f"{our_name}#{offset}")
        if arch.tie_word_embeddings or "lm_head.weight" not in loaded:
            if not arch.tie_word_embeddings and "lm_head.weight" not in loaded:
                raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
            params["lm_head.weight"].copy_(params["embed_tokens.weight"])
            loaded.add("lm_head.weight")
    if unexpected:
        raise ValueError(f"unexpected weights in checkpoint: {unexpected[:8]}")
    missing = [n for n in _expected(params, shard_sizes) if n not in loaded]
    if missing:
        raise ValueError(f"weights missing from checkpoint: {missing[:8]}")


def _target(name: str, shard_sizes: dict[str, tuple[int, ...]]) -> tuple[str, int | None, int] | None:
    """HF name -> (our parameter name, row offset or None, rows)."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
        return name, None, 0
    if not name.startswith("layers."):
        return None
    _, idx, rest = name.split(".", 2)
    module, _, kind = rest.rpartition(".")
    if module in _FUSED:
        fused, shard = _FUSED[module]
        sizes = shard_sizes[fused]
        return f"layers.{idx}.{fused}.{kind}", sum(sizes[:shard]), sizes[shard]
    if module in _RENAMED:
        return f"layers.{idx}.{_RENAMED[module]}.{kind}", None, 0
    return None


def _expected(params: dict[str, torch.nn.Parameter], shard_sizes: dict[str, tuple[int, ...]]) -> list[str]:
    names = []
    for name in params:
        fused = name.split(".")[-2] if name.startswith("layers.") else ""
        if fused in shard_sizes:
            sizes = shard_sizes[fused]
            names.extend(f"{name}#{sum(sizes[:i])}" for i in range(len(sizes)))
        else:
            names.append(name)
    return names
