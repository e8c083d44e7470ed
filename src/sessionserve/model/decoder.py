"""The Llama / Qwen2 / Qwen3 decoder over a paged KV cache.

One implementation for the family; the flavour flags of `ModelArch` switch
q/k/v bias (Qwen2) and per-head q/k RMSNorm (Qwen3). Projections are fused at
load time (q|k|v into one matrix, gate|up into another) so a decode step runs
two large GEMMs per layer instead of five small ones; `gate_up_proj` returns
the activated product silu(gate) * up.

Input is a flat batch of T tokens from any mix of prefill chunks and decode
steps; `AttentionMetadata` says which rows belong to which sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from sessionserve.model.attention import AttentionMetadata, attention, write_kv
from sessionserve.model.hf_config import ModelArch
from sessionserve.model.layers import RMSNorm, RotaryEmbedding, SiluGateUp


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.scale = arch.head_dim ** -0.5
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.gate_up_proj = SiluGateUp(arch.hidden_size, arch.intermediate_size)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x: (T, hidden), updated in place (the residual stream). With `keep_rows`, every row's K/V
        is stored but only those rows go on past it (attention from `meta.sampled`): returns (len, hidden)."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x))  # (T, q + 2kv)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        write_kv(k_cache, v_cache, k, v, meta)
        if keep_rows is not None:
            assert meta.sampled is not None and len(keep_rows) == sum(n for _, n in meta.sampled.paged_q_spans)
            x, q, k, v, meta = x[keep_rows], q[keep_rows], k[keep_rows], v[keep_rows], meta.sampled
            num_tokens = x.shape[0]
            if num_tokens == 0:
                return x
        o = attention(q, k, v, k_cache, v_cache, meta, self.scale)  # (T, H, D)
        # x += o_proj(o) in place, then normalize: the residual add fused into the norm.
        h = self.post_attention_layernorm(x, self.o_proj(o.reshape(num_tokens, self.q_size)))
        return x.add_(self.down_proj(self.gate_up_proj(h)))


class DecoderModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head."""

    def __init__(self, arch: ModelArch, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rope = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, logits_rows: torch.Tensor) -> torch.Tensor:
        """Run the flat batch; return logits (float32) for `logits_rows` only: (S, vocab)."""
        x = self.embed_tokens(input_ids)  # (T, hidden)
        *body, last = zip(self.layers, kv_caches)
        for layer, (k_cache, v_cache) in body:
            x = layer(x, positions, self.rope, k_cache, v_cache, meta)
        layer, (k_cache, v_cache) = last
        if meta.sampled is None:  # every row is sampled (decode, verification)
            x = layer(x, positions, self.rope, k_cache, v_cache, meta)[logits_rows]
        else:  # past the last layer's K/V only the sampled rows matter: the rest of it runs on them alone
            x = layer(x, positions, self.rope, k_cache, v_cache, meta, keep_rows=logits_rows)
        return self.lm_head(self.norm(x)).float()  # (S, vocab)
