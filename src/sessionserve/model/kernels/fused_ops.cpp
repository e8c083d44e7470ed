// Fused element-wise ops of the decoder (RMSNorm with the residual add, RoPE, SiLU-and-multiply): model/fused_ops.py.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cmath>
#include <type_traits>
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

// 16 floats rounded to bf16 precision (nearest even; NaN stays NaN), still as floats: what c10::BFloat16 keeps.
inline vf round_bf16(vf v) {
  vu u;
  std::memcpy(&u, &v, sizeof(u));
  const vu r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  vf out;
  std::memcpy(&out, &r, sizeof(out));
  return v != v ? v : out;
}
inline vf round_to_v(vf v, const c10::BFloat16*) { return round_bf16(v); }
inline vf round_to_v(vf v, const float*) { return v; }
inline void store_f(c10::BFloat16* p, vf v) {  // v already rounded: the top halves
  vu u;
  std::memcpy(&u, &v, sizeof(u));
  const vh h = __builtin_convertvector(u >> 16, vh);
  std::memcpy(p, &h, sizeof(h));
}
inline void store_f(float* p, vf v) { storeu(p, v); }

// silu(g) = g / (1 + exp(-g)); exp only of -|g| <= 0 (the paged kernel's vexp): g e / (1 + e) for g < 0.
// Below -87 exp underflows where ATen's vectorized silu flushes it to 0 (vexp would clamp it): 0 there too.
inline vf vsilu(vf g) {
  const vf zero = splat(0.f);
  const vf neg = g < zero ? g : -g;
  const vf e = neg < splat(-87.f) ? zero : vexp(neg);
  return (g < zero ? g * e : g) / (e + 1.f);
}
inline float silu(float g) {
  const float neg = g < 0 ? g : -g;
  const float e = neg < -87.f ? 0.f : std::exp(neg);
  return (g < 0 ? g * e : g) / (e + 1.f);
}

// out = dtype(dtype(silu(gate)) * up) for rows of [gate | up]: eager `F.silu(gate).mul_(up)` in one pass
// (it reads gate, writes silu, reads it and up, writes the product: five passes over the row).
// Vectors for float32 and bfloat16; other dtypes element by element.
template <typename scalar_t>
void silu_and_mul_impl(const scalar_t* gu, scalar_t* out, int64_t rows, int64_t n, int64_t stride) {
  constexpr bool kVec = std::is_same<scalar_t, float>::value || std::is_same<scalar_t, c10::BFloat16>::value;
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = gu + r * stride;
      const scalar_t* u = g + n;
      scalar_t* o = out + r * n;
      int64_t c = 0;
      if constexpr (kVec) {
        for (; c + W <= n; c += W) {
          const vf s = round_to_v(vsilu(load_f(g + c)), g);  // rounded to the dtype, as eager's silu output is
          store_f(o + c, round_to_v(s * load_f(u + c), g));
        }
      }
      for (; c < n; ++c)
        o[c] = round_to<scalar_t>(static_cast<float>(round_to<scalar_t>(silu(static_cast<float>(g[c])))) *
                                  static_cast<float>(u[c]));
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up: (rows, 2 * n) with contiguous rows");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = at::empty({rows, n}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_impl<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, n,
                                gate_up.stride(0));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sessionserve_kernels, m) {
  m.def("rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("rope_", c10::DispatchKey::CPU, TORCH_FN(rope_));
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(silu_and_mul));
}
