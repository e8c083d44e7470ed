"""CPU paged-attention kernel (C++, built on first use) with a pure-torch fallback.

The same extension carries the fused element-wise ops of `fused_ops.py`.

Decode attention is memory-bound: every step reads each running sequence's
whole context. Gathering the context into a contiguous tensor first (what a
torch-only path must do) reads and writes it once more. This kernel streams
keys and values straight out of the block pool with an online softmax, and the
query heads that share a KV head (GQA) share each read.

The extension is compiled with the system compiler into a cache folder keyed
by the source and the torch version; if that fails (no compiler, no ninja),
`available()` is False and attention uses the gather path.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <limits>

namespace {

constexpr int kMaxGroup = 16;    // query heads per KV head
constexpr int kMaxHeadDim = 256;
constexpr int kMaxBlock = 64;

// q: (T, H, D); caches: (NB, Hkv, BS, D); block_tables: (S, MB) int32;
// seq_idx, pos: (T,) int32. Query t attends to keys [0, pos[t]] of sequence seq_idx[t].
// Inputs may be float32, bfloat16 or float16; all arithmetic is in float32.
template <typename scalar_t>
void paged_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const int32_t* bt, const int32_t* si, const int32_t* ps, int64_t MB,
                          float sc, at::Tensor& out) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), BS = k_cache.size(2);
  const int64_t G = H / Hkv;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();

  at::parallel_for(0, T * Hkv, 1, [&](int64_t begin, int64_t end) {
    float acc[kMaxGroup][kMaxHeadDim];
    float qf[kMaxGroup][kMaxHeadDim];
    float row[kMaxHeadDim];
    float m[kMaxGroup], l[kMaxGroup], s[kMaxGroup][kMaxBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / Hkv, kh = task % Hkv;
      const scalar_t* qt = qp + (t * H + kh * G) * D;
      const int32_t* table = bt + static_cast<int64_t>(si[t]) * MB;
      const int64_t ctx = static_cast<int64_t>(ps[t]) + 1;
      for (int64_t g = 0; g < G; ++g) {
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
        for (int64_t d = 0; d < D; ++d) {
          acc[g][d] = 0.f;
          qf[g][d] = static_cast<float>(qt[g * D + d]);
        }
      }
      for (int64_t b = 0; b * BS < ctx; ++b) {
        const int64_t n = std::min<int64_t>(BS, ctx - b * BS);
        const int64_t off = ((static_cast<int64_t>(table[b]) * Hkv + kh) * BS) * D;
        const scalar_t* kb = kp + off;
        const scalar_t* vb = vp + off;
        for (int64_t j = 0; j < n; ++j) {
          const scalar_t* kj = kb + j * D;
          for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(kj[d]);
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf[g];
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * row[d];
            s[g][j] = dot * sc;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          float bmax = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < n; ++j) bmax = std::max(bmax, s[g][j]);
          const float new_m = std::max(m[g], bmax);
          const float corr = std::exp(m[g] - new_m);
          l[g] *= corr;
          float* ag = acc[g];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] *= corr;
          for (int64_t j = 0; j < n; ++j) {
            s[g][j] = std::exp(s[g][j] - new_m);
            l[g] += s[g][j];
          }
          m[g] = new_m;
        }
        for (int64_t j = 0; j < n; ++j) {
          const scalar_t* vj = vb + j * D;
          for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(vj[d]);
          for (int64_t g = 0; g < G; ++g) {
            const float p = s[g][j];
            float* ag = acc[g];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        scalar_t* o = op + (t * H + kh * G + g) * D;
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[g][d] * inv);
      }
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_idx,
                           const at::Tensor& pos, double scale) {
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(1), BS = k_cache.size(2);
  TORCH_CHECK(H / Hkv <= kMaxGroup && D <= kMaxHeadDim && BS <= kMaxBlock, "shape out of kernel limits");
  auto out = at::empty_like(q);
  const auto tables = block_tables.contiguous();
  const auto seqs = seq_idx.contiguous();
  const auto positions = pos.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    paged_attention_impl<scalar_t>(q, k_cache, v_cache, tables.data_ptr<int32_t>(), seqs.data_ptr<int32_t>(),
                                   positions.data_ptr<int32_t>(), tables.size(1), static_cast<float>(scale), out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(sessionserve_kernels, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_idx, Tensor pos, float scale) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
}
"""

_lock = threading.Lock()
_state: dict[str, bool] = {}


def _sources() -> list[str]:
    from sessionserve.model.fused_ops import SOURCE as fused_source

    return [_SOURCE, fused_source]


def _build_dir() -> Path:
    key = hashlib.sha256(("".join(_sources()) + torch.__version__).encode()).hexdigest()[:16]
    path = Path.home() / ".cache" / "sessionserve" / "kernels" / key
    path.mkdir(parents=True, exist_ok=True)
    return path


def available() -> bool:
    """Build (once per process, cached on disk) and report whether the kernel loaded."""
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
        return _state["ok"]


def _load() -> bool:
    try:
        from torch.utils.cpp_extension import load_inline

        load_inline(
            name="sessionserve_kernels",
            cpp_sources=_sources(),
            extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
            build_directory=str(_build_dir()),
            is_python_module=False,
            verbose=False,
        )
        ops = torch.ops.sessionserve_kernels
        return all(hasattr(ops, name) for name in ("paged_attention", "rms_norm", "rope_"))
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the fallback
        logger.warning("paged attention kernel unavailable, using the gather path: %s", exc)
        return False


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_idx: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
    """(T, H, D) attention of each query over its sequence's keys [0, pos]. Reads the caches only."""
    return torch.ops.sessionserve_kernels.paged_attention(
        q.contiguous(), k_cache, v_cache, block_tables, seq_idx, pos, scale)
