// Paged attention over the block tables (decode and prefill after a prefix hit): model/paged_kernel.py.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

namespace {

constexpr int kMaxGroup = 16;    // query heads per KV head
constexpr int kMaxHeadDim = 256;
constexpr int kMaxBlock = 64;

// 16 floats as a GCC/Clang vector: one AVX-512 register, two AVX2 ones.
constexpr int W = 16;
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint16_t vh __attribute__((vector_size(W * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));
typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
typedef int32_t vi8 __attribute__((vector_size(8 * sizeof(int32_t))));

inline vf splat(float x) { return vf{} + x; }
inline vf loadu(const float* p) { vf v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void storeu(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf load_f(const float* p) { return loadu(p); }
inline vf load_f(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  vh h;
  std::memcpy(&h, p, sizeof(h));
  const vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}
template <typename T>
inline vf load_f(const T* p) {  // half, double: element by element
  vf v;
  for (int i = 0; i < W; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
inline float hsum(vf v) {
  vf8 a, b;
  std::memcpy(&a, &v, sizeof(a));
  std::memcpy(&b, reinterpret_cast<const char*>(&v) + sizeof(a), sizeof(b));
  a += b;
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}
// exp for x <= 0 (scores minus their running max): Cody-Waite reduction, degree-6 polynomial,
// relative error ~2 ulp; inputs below -87 flush to exp(-87) ~ 1.6e-38. V: a float vector type, VI: the
// int32 vector of its width.
template <typename V, typename VI>
inline V vexp_n(V x) {
  const V lo = V{} - 87.f;
  x = x < lo ? lo : x;
  const V t = x * 1.44269504088896341f;
  const VI n = __builtin_convertvector(t - 0.5f, VI);  // round to nearest for t <= 0
  const V nf = __builtin_convertvector(n, V);
  const V r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const VI e = (n + 127) << 23;
  V scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return p * scale;
}
inline vf vexp(vf x) { return vexp_n<vf, vi>(x); }

// Bring n elements from p on into cache ahead of use.
template <typename T>
inline void prefetch_span(const T* p, int64_t n) {
  const char* b = reinterpret_cast<const char*>(p);
  for (int64_t byte = 0; byte < n * static_cast<int64_t>(sizeof(T)); byte += 64) __builtin_prefetch(b + byte);
}

// The online softmax of a block, on vectors V of L floats (VI: their int32 twin): s[g][0, n) become
// exp(s - m_new), the running sum l and max m of each head are updated and its output acc rescaled.
template <typename V, typename VI>
inline void online_softmax(float (*s)[kMaxBlock], int64_t n, int64_t G, int64_t D, float* m, float* l,
                           float (*acc)[kMaxHeadDim]) {
  constexpr int64_t L = sizeof(V) / sizeof(float);
  const int64_t chunks = (n + L - 1) / L;
  V x;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t j = n; j < chunks * L; ++j) s[g][j] = -std::numeric_limits<float>::infinity();
    V mx;
    std::memcpy(&mx, s[g], sizeof(mx));
    for (int64_t c = 1; c < chunks; ++c) {
      std::memcpy(&x, s[g] + c * L, sizeof(x));
      mx = mx > x ? mx : x;
    }
    float bmax = mx[0];
    for (int i = 1; i < L; ++i) bmax = std::max(bmax, mx[i]);
    const float new_m = std::max(m[g], bmax);
    const float corr = std::exp(m[g] - new_m);
    V sum = V{};
    for (int64_t c = 0; c < chunks; ++c) {
      std::memcpy(&x, s[g] + c * L, sizeof(x));
      const V e = vexp_n<V, VI>(x - new_m);
      std::memcpy(s[g] + c * L, &e, sizeof(e));
      sum += e;
    }
    // lanes past n hold exp(-87) ~ 1e-38 each: far below float resolution of l
    float total = 0.f;
    for (int i = 0; i < L; ++i) total += sum[i];
    l[g] = l[g] * corr + total;
    m[g] = new_m;
    if (corr != 1.f) {
      for (int64_t d = 0; d < D; d += L) {
        std::memcpy(&x, acc[g] + d, sizeof(x));
        x *= corr;
        std::memcpy(acc[g] + d, &x, sizeof(x));
      }
    }
  }
}

// One block's steps on 16-float vectors, for any dtype and group size: scores s[g][j] = q[g] . k[j], their
// online softmax, and acc[g] += s[g][j] * v[j] (the sums of a group kept in memory).
struct VecBlockSteps {
  template <typename scalar_t>
  void scores(const float (*qf)[kMaxHeadDim], const scalar_t* kb, int64_t n, int64_t G, int64_t C, int64_t D,
              float (*s)[kMaxBlock], const scalar_t* next) const {
    if (next != nullptr) prefetch_span(next, n * D);
    for (int64_t j = 0; j < n; ++j) {
      const scalar_t* kj = kb + j * D;
      if (G == 1) {  // one query head: reuse nothing, keep the loads in flight
        vf a = vf{};
        for (int64_t c = 0; c < C; ++c) a += loadu(qf[0] + c * W) * load_f(kj + c * W);
        s[0][j] = hsum(a);
        continue;
      }
      vf a[kMaxGroup];
      for (int64_t g = 0; g < G; ++g) a[g] = vf{};
      for (int64_t c = 0; c < C; ++c) {
        const vf kc = load_f(kj + c * W);
        for (int64_t g = 0; g < G; ++g) a[g] += loadu(qf[g] + c * W) * kc;
      }
      for (int64_t g = 0; g < G; ++g) s[g][j] = hsum(a[g]);
    }
  }
  void softmax(float (*s)[kMaxBlock], int64_t n, int64_t G, int64_t D, float* m, float* l,
               float (*acc)[kMaxHeadDim]) const {
    online_softmax<vf, vi>(s, n, G, D, m, l, acc);
  }
  template <typename scalar_t>
  void values(float (*acc)[kMaxHeadDim], const float (*s)[kMaxBlock], const scalar_t* vb, int64_t n, int64_t G,
              int64_t C, int64_t D, const scalar_t* next) const {
    if (next != nullptr) prefetch_span(next, n * D);
    for (int64_t j = 0; j < n; ++j) {
      const scalar_t* vj = vb + j * D;
      for (int64_t c = 0; c < C; ++c) {
        const vf vc = load_f(vj + c * W);
        for (int64_t g = 0; g < G; ++g) storeu(acc[g] + c * W, loadu(acc[g] + c * W) + s[g][j] * vc);
      }
    }
  }
};

// q: (T, H, D); caches: (NB, Hkv, BS, D); block_tables: (S, MB) int32;
// seq_idx, pos: (T,) int32. Query t attends to keys [0, pos[t]] of sequence seq_idx[t].
// Inputs may be float32, bfloat16 or float16; all arithmetic is in float32 (D % 16 == 0). Scores of
// one block for each query head are computed, exponentiated and summed as vectors (online softmax);
// the running output of the G heads sharing a KV head stays in one buffer. `step` computes a block's
// scores, their softmax, and adds its values (VecBlockSteps, or Avx2BlockSteps on AVX2), fetching the
// next block's rows as it goes.
template <typename scalar_t, typename Steps = VecBlockSteps>
void paged_attention_vec(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const int32_t* bt, const int32_t* si, const int32_t* ps, int64_t MB,
                         float sc, at::Tensor& out, Steps step = {}) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), BS = k_cache.size(2);
  const int64_t G = H / Hkv, C = D / W;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();

  at::parallel_for(0, T * Hkv, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kMaxGroup][kMaxHeadDim];
    alignas(64) float qf[kMaxGroup][kMaxHeadDim];
    alignas(64) float s[kMaxGroup][kMaxBlock];
    float m[kMaxGroup], l[kMaxGroup];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / Hkv, kh = task % Hkv, ctx = static_cast<int64_t>(ps[t]) + 1;
      const scalar_t* qt = qp + (t * H + kh * G) * D;
      const int32_t* table = bt + static_cast<int64_t>(si[t]) * MB;
      for (int64_t g = 0; g < G; ++g) {
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
        for (int64_t c = 0; c < C; ++c) {
          storeu(acc[g] + c * W, vf{});
          storeu(qf[g] + c * W, load_f(qt + g * D + c * W) * sc);
        }
      }
      for (int64_t b = 0; b * BS < ctx; ++b) {
        const int64_t n = std::min<int64_t>(BS, ctx - b * BS);
        const int64_t off = ((static_cast<int64_t>(table[b]) * Hkv + kh) * BS) * D;
        const scalar_t* kb = kp + off;
        const scalar_t* vb = vp + off;
        // blocks are scattered: each step fetches its rows of the next block while it computes this one's
        const bool more = (b + 1) * BS < ctx;
        const int64_t next = more ? ((static_cast<int64_t>(table[b + 1]) * Hkv + kh) * BS) * D : 0;
        step.scores(qf, kb, n, G, C, D, s, more ? kp + next : nullptr);
        step.softmax(s, n, G, D, m, l, acc);
        step.values(acc, s, vb, n, G, C, D, more ? vp + next : nullptr);
      }
      for (int64_t g = 0; g < G; ++g) {
        scalar_t* o = op + (t * H + kh * G + g) * D;
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[g][d] * inv);
      }
    }
  });
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define SESSIONSERVE_BF16_DECODE 1

// lane i of the result = sum of the 16 lanes of v[i]: four levels of pairwise unpack/shuffle and add,
// ~3 instructions per input vector instead of a full horizontal sum each.
inline __m512 reduce16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane L: lane L's sums of vectors 4k..4k+3
    const __m512d c = _mm512_castps_pd(t[2 * k]), d = _mm512_castps_pd(t[2 * k + 1]);
    u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
  }
  for (int k = 0; k < 2; ++k)
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// The same contract as paged_attention_vec for bf16 with D % 32 == 0 and an even block size, on
// `vdpbf16ps`: q . k takes D / 32 instructions per (head, key), and sixteen keys' partial sums are
// reduced together; P V multiplies pairs of keys (their value rows interleaved by unpack) with the
// probabilities rounded to bf16, into float32 accumulators whose dims are in unpack order
// (restored when the output is written).
void paged_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const int32_t* bt, const int32_t* si, const int32_t* ps, int64_t MB, float sc,
                          at::Tensor& out) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), BS = k_cache.size(2);
  const int64_t G = H / Hkv, C = D / 32;
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());

  at::parallel_for(0, T * Hkv, 1, [&](int64_t begin, int64_t end) {
    __m512i qv[kMaxGroup][kMaxHeadDim / 32];
    __m512 acc[kMaxGroup][kMaxHeadDim / 16];
    __m512 part[kMaxGroup][16];
    __m512 s[kMaxGroup][kMaxBlock / 16];
    alignas(64) uint16_t pb[kMaxGroup][kMaxBlock];
    alignas(64) float row[kMaxHeadDim];
    float m[kMaxGroup], l[kMaxGroup];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / Hkv, kh = task % Hkv, ctx = static_cast<int64_t>(ps[t]) + 1;
      const uint16_t* qt = qp + (t * H + kh * G) * D;
      const int32_t* table = bt + static_cast<int64_t>(si[t]) * MB;
      for (int64_t g = 0; g < G; ++g) {
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
        for (int64_t c = 0; c < C; ++c) qv[g][c] = _mm512_loadu_si512(qt + g * D + c * 32);
        for (int64_t c = 0; c < 2 * C; ++c) acc[g][c] = _mm512_setzero_ps();
      }
      for (int64_t b = 0; b * BS < ctx; ++b) {
        const int64_t n = std::min<int64_t>(BS, ctx - b * BS);
        const int64_t off = ((static_cast<int64_t>(table[b]) * Hkv + kh) * BS) * D;
        const uint16_t* kb = kp + off;
        const uint16_t* vb = vp + off;
        if ((b + 1) * BS < ctx) {  // blocks are scattered: fetch the next one while this one computes
          const int64_t next = ((static_cast<int64_t>(table[b + 1]) * Hkv + kh) * BS) * D;
          prefetch_span(kp + next, BS * D);
          prefetch_span(vp + next, BS * D);
        }
        const int64_t chunks = (n + 15) / 16;
        for (int64_t jc = 0; jc < chunks; ++jc) {
          for (int64_t jj = 0; jj < 16; ++jj) {
            const int64_t j = jc * 16 + jj;
            if (j >= n) {
              for (int64_t g = 0; g < G; ++g) part[g][jj] = _mm512_setzero_ps();
              continue;
            }
            const uint16_t* kj = kb + j * D;
            for (int64_t g = 0; g < G; ++g) part[g][jj] = _mm512_setzero_ps();
            for (int64_t c = 0; c < C; ++c) {
              const __m512bh kc = (__m512bh)_mm512_loadu_si512(kj + c * 32);
              for (int64_t g = 0; g < G; ++g) part[g][jj] = _mm512_dpbf16_ps(part[g][jj], (__m512bh)qv[g][c], kc);
            }
          }
          const int64_t valid = std::min<int64_t>(16, n - jc * 16);
          const __mmask16 keep = valid == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
          for (int64_t g = 0; g < G; ++g)
            s[g][jc] = _mm512_mask_blend_ps(keep, neg_inf, _mm512_mul_ps(reduce16(part[g]), _mm512_set1_ps(sc)));
        }
        for (int64_t g = 0; g < G; ++g) {
          __m512 mx = s[g][0];
          for (int64_t jc = 1; jc < chunks; ++jc) mx = _mm512_max_ps(mx, s[g][jc]);
          const float new_m = std::max(m[g], _mm512_reduce_max_ps(mx));
          const float corr = std::exp(m[g] - new_m);
          const __m512 mv = _mm512_set1_ps(new_m);
          __m512 sum = _mm512_setzero_ps();
          for (int64_t jc = 0; jc < chunks; ++jc) {
            const __mmask16 keep = _mm512_cmp_ps_mask(s[g][jc], neg_inf, _CMP_NEQ_OQ);
            vf e;
            const __m512 x = _mm512_sub_ps(s[g][jc], mv);
            std::memcpy(&e, &x, sizeof(e));
            e = vexp(e);
            __m512 ev;
            std::memcpy(&ev, &e, sizeof(ev));
            ev = _mm512_maskz_mov_ps(keep, ev);  // masked keys: exactly 0
            sum = _mm512_add_ps(sum, ev);
            const __m256bh h = _mm512_cvtneps_pbh(ev);
            std::memcpy(&pb[g][jc * 16], &h, sizeof(h));
          }
          l[g] = l[g] * corr + _mm512_reduce_add_ps(sum);
          m[g] = new_m;
          if (corr != 1.f) {
            const __m512 cv = _mm512_set1_ps(corr);
            for (int64_t c = 0; c < 2 * C; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], cv);
          }
        }
        for (int64_t j = 0; j < n; j += 2) {  // key j + 1 < BS (BS even); past n its p is 0
          const uint16_t* v0 = vb + j * D;
          const uint16_t* v1 = v0 + D;
          __m512i pair[kMaxGroup];
          for (int64_t g = 0; g < G; ++g) {
            uint32_t w;
            std::memcpy(&w, &pb[g][j], sizeof(w));
            pair[g] = _mm512_set1_epi32(static_cast<int>(w));
          }
          for (int64_t c = 0; c < C; ++c) {
            const __m512i a = _mm512_loadu_si512(v0 + c * 32), bv = _mm512_loadu_si512(v1 + c * 32);
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, bv), hi = (__m512bh)_mm512_unpackhi_epi16(a, bv);
            for (int64_t g = 0; g < G; ++g) {
              acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], (__m512bh)pair[g], lo);
              acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], (__m512bh)pair[g], hi);
            }
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const __m512 inv = _mm512_set1_ps(1.f / l[g]);
        for (int64_t c = 0; c < C; ++c) {  // lane 4L + i of acc[2c] is dim 32c + 8L + i; of acc[2c+1], + 4
          alignas(64) float lo[16], hi[16];
          _mm512_store_ps(lo, _mm512_mul_ps(acc[g][2 * c], inv));
          _mm512_store_ps(hi, _mm512_mul_ps(acc[g][2 * c + 1], inv));
          for (int L = 0; L < 4; ++L)
            for (int i = 0; i < 4; ++i) {
              row[c * 32 + 8 * L + i] = lo[4 * L + i];
              row[c * 32 + 8 * L + 4 + i] = hi[4 * L + i];
            }
        }
        uint16_t* o = op + (t * H + kh * G + g) * D;
        for (int64_t c = 0; c < D / 16; ++c) {
          const __m256bh y = _mm512_cvtneps_pbh(_mm512_load_ps(row + c * 16));
          std::memcpy(o + c * 16, &y, sizeof(y));
        }
      }
    }
  });
}
#endif  // AVX512-BF16

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SESSIONSERVE_AVX2_DECODE 1

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// Lane i of the result = the sum of v[i]'s 8 lanes, for KJ = 4 vectors (lanes 0-3) or 2 (lanes 0-1):
// horizontal adds over all of them at once, 5 instructions where one sum at a time takes 6 each.
template <int KJ>
inline __m128 reduce8(const __m256* v) {
  if constexpr (KJ == 4) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  } else {
    const __m256 t = _mm256_hadd_ps(v[0], v[1]);
    const __m128 x = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    return _mm_hadd_ps(x, x);
  }
}

// Scores of one block's n keys for NG query heads sharing a KV head: s[g][j] = q[g] . k[j]. NG is a
// compile-time count; KJ keys at a time, so the NG x KJ running sums are registers, each key row is read
// once for all NG, and the KJ sums of a head are reduced together.
template <int NG, typename scalar_t>
inline void scores_avx2(const float (*qf)[kMaxHeadDim], const scalar_t* kb, int64_t n, int64_t D, float (*s)[kMaxBlock],
                        const scalar_t* next) {
  constexpr int KJ = NG <= 3 ? 4 : 2;
  int64_t j = 0;
  for (; j + KJ <= n; j += KJ) {
    if (next != nullptr) prefetch_span(next + j * D, KJ * D);
    __m256 a[NG][KJ];
    for (int g = 0; g < NG; ++g)
      for (int jj = 0; jj < KJ; ++jj) a[g][jj] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      for (int jj = 0; jj < KJ; ++jj) {
        const __m256 k = load8(kb + (j + jj) * D + d);
        for (int g = 0; g < NG; ++g) a[g][jj] = _mm256_fmadd_ps(_mm256_load_ps(qf[g] + d), k, a[g][jj]);
      }
    }
    for (int g = 0; g < NG; ++g) {
      const __m128 r = reduce8<KJ>(a[g]);
      if constexpr (KJ == 4) _mm_storeu_ps(s[g] + j, r);
      else _mm_storel_pi(reinterpret_cast<__m64*>(s[g] + j), r);
    }
  }
  for (; j < n; ++j) {
    if (next != nullptr) prefetch_span(next + j * D, D);
    __m256 a[NG];
    for (int g = 0; g < NG; ++g) a[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 k = load8(kb + j * D + d);
      for (int g = 0; g < NG; ++g) a[g] = _mm256_fmadd_ps(_mm256_load_ps(qf[g] + d), k, a[g]);
    }
    for (int g = 0; g < NG; ++g) s[g][j] = hsum8(a[g]);
  }
}

// acc[g][d, d + 8 NV) += sum_j p[g][j] * v[j][d, d + 8 NV) for NG heads: the NG x NV slices are registers
// over the block's keys, loaded and stored once per block.
template <int NG, int NV, typename scalar_t>
inline void values_slice(float (*acc)[kMaxHeadDim], const float (*p)[kMaxBlock], const scalar_t* vb, int64_t n,
                         int64_t D, int64_t d, const scalar_t* next) {
  __m256 r[NG][NV];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < NV; ++c) r[g][c] = _mm256_load_ps(acc[g] + d + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    if (next != nullptr) prefetch_span(next + j * D, D);
    const scalar_t* vj = vb + j * D + d;
    for (int g = 0; g < NG; ++g) {
      const __m256 w = _mm256_broadcast_ss(p[g] + j);
      for (int c = 0; c < NV; ++c) r[g][c] = _mm256_fmadd_ps(w, load8(vj + 8 * c), r[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < NV; ++c) _mm256_store_ps(acc[g] + d + 8 * c, r[g][c]);
}

// acc[g] += sum_j p[g][j] * v[j] for NG heads, 32 dimensions at a time for up to 3 heads (16 for 4); the
// first slice's pass over the keys fetches the rows of `next` (or nullptr).
template <int NG, typename scalar_t>
inline void values_avx2(float (*acc)[kMaxHeadDim], const float (*p)[kMaxBlock], const scalar_t* vb, int64_t n,
                        int64_t D, const scalar_t* next) {
  constexpr int NV = NG <= 3 ? 4 : 2;
  int64_t d = 0;
  for (; d + 8 * NV <= D; d += 8 * NV, next = nullptr) values_slice<NG, NV>(acc, p, vb, n, D, d, next);
  for (; d < D; d += 16, next = nullptr) values_slice<NG, 2>(acc, p, vb, n, D, d, next);  // D % 16 == 0
}

// f(std::integral_constant<int, NG>{}, g0) for the G heads of a KV head in groups [g0, g0 + NG) of up to 4.
template <typename F>
inline void by_head_groups(int64_t G, F&& f) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: f(std::integral_constant<int, 1>{}, g0); break;
      case 2: f(std::integral_constant<int, 2>{}, g0); break;
      case 3: f(std::integral_constant<int, 3>{}, g0); break;
      default: f(std::integral_constant<int, 4>{}, g0); break;
    }
  }
}

// The block steps for float32 and bfloat16 on AVX2 (D % 16 == 0): the G heads of a KV head in groups of up
// to 4 whose sums stay in registers over the block (the vector steps keep them in memory), and the
// softmax on 8-float registers.
struct Avx2BlockSteps {
  template <typename scalar_t>
  void scores(const float (*qf)[kMaxHeadDim], const scalar_t* kb, int64_t n, int64_t G, int64_t, int64_t D,
              float (*s)[kMaxBlock], const scalar_t* next) const {
    by_head_groups(G, [&](auto ng, int64_t g0) {
      scores_avx2<decltype(ng)::value>(qf + g0, kb, n, D, s + g0, g0 == 0 ? next : nullptr);
    });
  }
  void softmax(float (*s)[kMaxBlock], int64_t n, int64_t G, int64_t D, float* m, float* l,
               float (*acc)[kMaxHeadDim]) const {
    online_softmax<vf8, vi8>(s, n, G, D, m, l, acc);
  }
  template <typename scalar_t>
  void values(float (*acc)[kMaxHeadDim], const float (*s)[kMaxBlock], const scalar_t* vb, int64_t n, int64_t G,
              int64_t, int64_t D, const scalar_t* next) const {
    by_head_groups(G, [&](auto ng, int64_t g0) {
      values_avx2<decltype(ng)::value>(acc + g0, s + g0, vb, n, D, g0 == 0 ? next : nullptr);
    });
  }
};
#endif  // AVX2 + FMA

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_idx,
                           const at::Tensor& pos, double scale) {
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(1), BS = k_cache.size(2);
  TORCH_CHECK(H / Hkv <= kMaxGroup && D <= kMaxHeadDim && D % W == 0 && BS <= kMaxBlock,
              "shape out of kernel limits");
  auto out = at::empty_like(q);
  const auto tables = block_tables.contiguous();
  const auto seqs = seq_idx.contiguous();
  const auto positions = pos.contiguous();
#ifdef SESSIONSERVE_BF16_DECODE
  if (q.scalar_type() == at::kBFloat16 && D % 32 == 0 && BS % 2 == 0) {
    paged_attention_bf16(q, k_cache, v_cache, tables.data_ptr<int32_t>(), seqs.data_ptr<int32_t>(),
                         positions.data_ptr<int32_t>(), tables.size(1), static_cast<float>(scale), out);
    return out;
  }
#endif
#ifdef SESSIONSERVE_AVX2_DECODE
  if (q.scalar_type() == at::kFloat) {
    paged_attention_vec<float>(q, k_cache, v_cache, tables.data_ptr<int32_t>(), seqs.data_ptr<int32_t>(),
                               positions.data_ptr<int32_t>(), tables.size(1), static_cast<float>(scale), out,
                               Avx2BlockSteps{});
    return out;
  }
  if (q.scalar_type() == at::kBFloat16) {  // without AVX512-BF16 (that path returned above)
    paged_attention_vec<c10::BFloat16>(q, k_cache, v_cache, tables.data_ptr<int32_t>(), seqs.data_ptr<int32_t>(),
                                       positions.data_ptr<int32_t>(), tables.size(1), static_cast<float>(scale), out,
                                       Avx2BlockSteps{});
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    paged_attention_vec<scalar_t>(q, k_cache, v_cache, tables.data_ptr<int32_t>(), seqs.data_ptr<int32_t>(), positions.data_ptr<int32_t>(),
         tables.size(1), static_cast<float>(scale), out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(sessionserve_kernels, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_idx, Tensor pos, float scale) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
}
