"""Small building blocks of the decoder: RMSNorm, the MLP's gated input and the rotary embedding (kernels in
fused_ops.py)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sessionserve.model import fused_ops


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as Hugging Face's Llama/Qwen do."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual_delta: torch.Tensor | None = None) -> torch.Tensor:
        """Normalize `x`; with `residual_delta`, first add it to `x` in place (the residual stream)."""
        return fused_ops.rms_norm(x, self.weight, self.eps, residual_delta)


class SiluGateUp(nn.Module):
    """The MLP's first half: silu(x Wg^T) * (x Wu^T), with [Wg; Wu] one (2I, H) `weight`, named as the fused
    linear it stands for (checkpoints load into it the same way). `packed_linear` swaps it on CPU for two
    oneDNN GEMMs that apply the SiLU and the product as they write their output."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_ops.silu_and_mul(F.linear(x, self.weight))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) with Hugging Face's rope scaling types.

    Supported: default, linear, llama3. Other types raise, so a model never
    silently runs with the wrong positions.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables; applied in Hugging Face's rotate-half layout."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (P, D/2)
        # Stored as (P, D/2): rotate-half needs cos/sin only once per half.
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q (T, H, D) and k (T, Hkv, D) in place at int64 `positions` (T,)."""
        return (fused_ops.rope_(q, positions, self.cos, self.sin),
                fused_ops.rope_(k, positions, self.cos, self.sin))
