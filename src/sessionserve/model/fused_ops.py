"""Fused element-wise ops of the decoder for CPU: RMSNorm (with the residual add) and RoPE.

Eager PyTorch runs each of these as several passes over memory with a fresh
tensor per op (RMSNorm alone is pow, mean, add, rsqrt, mul, cast, mul). One
C++ loop per op reads and writes each row once. The arithmetic follows
Hugging Face's Llama/Qwen modules step for step, including where they round
to the model dtype, so bf16 results match eager to rounding and float32 to
~1e-7.

The C++ source is compiled together with the paged-attention kernel
(`paged_kernel.py`); each wrapper falls back to the eager expression when the
extension is unavailable or the tensors are not on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cmath>
#include <vector>

namespace {

// Rows per task: keep small batches (a decode step) on one thread.
inline int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)); }

template <typename T> inline T round_to(float v) { return static_cast<T>(v); }

// out = w * to_dtype(x * rsqrt(mean(x^2) + eps)); with `delta`: x += delta first (in place, rounded to dtype).
template <typename scalar_t>
void rms_norm_impl(scalar_t* x, const scalar_t* delta, const scalar_t* w, scalar_t* out,
                   int64_t rows, int64_t cols, int64_t x_stride, int64_t d_stride, float eps) {
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(cols);
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* xr = x + r * x_stride;
      float ss = 0.f;
      if (delta != nullptr) {
        const scalar_t* dr = delta + r * d_stride;
        for (int64_t c = 0; c < cols; ++c) {
          const scalar_t s = round_to<scalar_t>(static_cast<float>(xr[c]) + static_cast<float>(dr[c]));
          xr[c] = s;
          buf[c] = static_cast<float>(s);
        }
      } else {
        for (int64_t c = 0; c < cols; ++c) buf[c] = static_cast<float>(xr[c]);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t c = 0; c < cols; ++c) ss += buf[c] * buf[c];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(cols) + eps);
      scalar_t* orow = out + r * cols;
      for (int64_t c = 0; c < cols; ++c) {
        const float n = static_cast<float>(round_to<scalar_t>(buf[c] * inv));
        orow[c] = round_to<scalar_t>(static_cast<float>(w[c]) * n);
      }
    }
  });
}

at::Tensor rms_norm(at::Tensor x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x: (rows, cols) with contiguous rows");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight: (cols,) of x's dtype");
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor d;
  if (delta.has_value()) {
    d = *delta;
    TORCH_CHECK(d.sizes() == x.sizes() && d.stride(1) == 1 && d.scalar_type() == x.scalar_type(),
                "delta: same shape and dtype as x, contiguous rows");
  }
  auto out = at::empty({rows, cols}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(x.data_ptr<scalar_t>(), d.defined() ? d.data_ptr<scalar_t>() : nullptr,
                            weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, cols, x.stride(0),
                            d.defined() ? d.stride(0) : 0, static_cast<float>(eps));
  });
  return out;
}

// In place, rotate-half layout: x (T, H, D) with x[t, h, :] contiguous; cos/sin (P, D/2) float32.
// Like HF: cos/sin rounded to x's dtype, each product and sum rounded to the dtype.
template <typename scalar_t>
void rope_impl(scalar_t* x, int64_t T, int64_t H, int64_t D, int64_t st, int64_t sh,
               const int64_t* pos, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  at::parallel_for(0, T, grain_rows(H * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = cos + pos[t] * half;
      const float* s_t = sin + pos[t] * half;
      for (int64_t h = 0; h < H; ++h) {
        scalar_t* v = x + t * st + h * sh;
        for (int64_t i = 0; i < half; ++i) {
          const float c = static_cast<float>(round_to<scalar_t>(ct[i]));
          const float s = static_cast<float>(round_to<scalar_t>(s_t[i]));
          const float a = static_cast<float>(v[i]), b = static_cast<float>(v[i + half]);
          const float ac = static_cast<float>(round_to<scalar_t>(a * c));
          const float bs = static_cast<float>(round_to<scalar_t>(b * s));
          const float bc = static_cast<float>(round_to<scalar_t>(b * c));
          const float as = static_cast<float>(round_to<scalar_t>(a * s));
          v[i] = round_to<scalar_t>(ac - bs);
          v[i + half] = round_to<scalar_t>(bc + as);
        }
      }
    }
  });
}

void rope_(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x: (T, H, D), heads contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
              "positions: (T,) int64");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
              cos.size(1) * 2 == x.size(2), "cos/sin: (P, D/2) float32");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    rope_impl<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1),
                        positions.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>());
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sessionserve_kernels, m) {
  m.def("rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("rope_", c10::DispatchKey::CPU, TORCH_FN(rope_));
}
"""


def _native(*tensors: torch.Tensor) -> bool:
    from sessionserve.model import paged_kernel

    return all(t.device.type == "cpu" for t in tensors) and paged_kernel.available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of `x` (rows, cols); with `delta`, first `x += delta` in place (the residual add)."""
    if _native(x) and x.dim() == 2 and x.stride(1) == 1:
        return torch.ops.sessionserve_kernels.rms_norm(x, delta, weight, eps)
    if delta is not None:
        x.add_(delta)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a fused (rows, 2 * intermediate) gate/up projection.

    Left to ATen: its vectorized exp beats a plain C++ loop here; the in-place
    multiply saves one temporary.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` (T, H, D) in place at `positions` with (P, D/2) float32 tables; returns `x`."""
    if _native(x) and x.stride(2) == 1 and x.stride(1) == x.shape[2] and positions.dtype == torch.int64:
        torch.ops.sessionserve_kernels.rope_(x, positions, cos, sin)
        return x
    c = cos[positions].unsqueeze(1).to(x.dtype)
    s = sin[positions].unsqueeze(1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    x.copy_(rotated)
    return x
