// Paged attention over the block tables (decode and prefill after a prefix hit): model/paged_kernel.py.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

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
// relative error ~2 ulp; inputs below -87 flush to exp(-87) ~ 1.6e-38.
inline vf vexp(vf x) {
  x = x < splat(-87.f) ? splat(-87.f) : x;
  const vf t = x * 1.44269504088896341f;
  const vi n = __builtin_convertvector(t - 0.5f, vi);  // round to nearest for t <= 0
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const vi e = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return p * scale;
}

// Bring n elements of keys and values into cache ahead of use.
template <typename T>
inline void prefetch_kv(const T* k, const T* v, int64_t n) {
  const char* kb = reinterpret_cast<const char*>(k);
  const char* vb = reinterpret_cast<const char*>(v);
  for (int64_t byte = 0; byte < n * static_cast<int64_t>(sizeof(T)); byte += 64) {
    __builtin_prefetch(kb + byte);
    __builtin_prefetch(vb + byte);
  }
}

// One block's steps on 16-float vectors, for any dtype and group size: scores s[g][j] = q[g] . k[j], and
// acc[g] += s[g][j] * v[j] (the sums of a group kept in memory).
struct VecBlockSteps {
  template <typename scalar_t>
  void scores(const float (*qf)[kMaxHeadDim], const scalar_t* kb, int64_t n, int64_t G, int64_t C, int64_t D,
              float (*s)[kMaxBlock]) const {
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
  template <typename scalar_t>
  void values(float (*acc)[kMaxHeadDim], const float (*s)[kMaxBlock], const scalar_t* vb, int64_t n, int64_t G,
              int64_t C, int64_t D) const {
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
// Inputs may be float32, bfloat16 or float16; all arithmetic is in float32, 16 lanes at a
// time (D % 16 == 0). Scores of one block for each query head are computed, exponentiated and
// summed as vectors (online softmax); the running output of the G heads sharing a KV head
// stays in one buffer. `step` computes a block's scores and adds its values (VecBlockSteps, or
// Avx2BlockSteps on AVX2).
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
        const int64_t chunks = (n + W - 1) / W;
        const int64_t off = ((static_cast<int64_t>(table[b]) * Hkv + kh) * BS) * D;
        const scalar_t* kb = kp + off;
        const scalar_t* vb = vp + off;
        if ((b + 1) * BS < ctx) {  // blocks are scattered: fetch the next one while this one computes
          const int64_t next = ((static_cast<int64_t>(table[b + 1]) * Hkv + kh) * BS) * D;
          prefetch_kv(kp + next, vp + next, BS * D);
        }
        step.scores(qf, kb, n, G, C, D, s);
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t j = n; j < chunks * W; ++j) s[g][j] = -std::numeric_limits<float>::infinity();
          vf mx = loadu(s[g]);
          for (int64_t c = 1; c < chunks; ++c) {
            const vf x = loadu(s[g] + c * W);
            mx = mx > x ? mx : x;
          }
          float bmax = mx[0];
          for (int i = 1; i < W; ++i) bmax = std::max(bmax, mx[i]);
          const float new_m = std::max(m[g], bmax);
          const float corr = std::exp(m[g] - new_m);
          vf sum = vf{};
          for (int64_t c = 0; c < chunks; ++c) {
            const vf e = vexp(loadu(s[g] + c * W) - new_m);
            storeu(s[g] + c * W, e);
            sum += e;
          }
          // lanes past n hold exp(-87) ~ 1e-38 each: far below float resolution of l
          l[g] = l[g] * corr + hsum(sum);
          m[g] = new_m;
          if (corr != 1.f) {
            for (int64_t c = 0; c < C; ++c) storeu(acc[g] + c * W, loadu(acc[g] + c * W) * corr);
          }
        }
        step.values(acc, s, vb, n, G, C, D);
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
          prefetch_kv(kp + next, vp + next, BS * D);
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

// Scores of one block's n keys for NG query heads sharing a KV head: s[g][j] = q[g] . k[j]. NG is a
// compile-time count, so the NG running sums are registers and each key row is read once for all NG.
template <int NG, typename scalar_t>
inline void scores_avx2(const float (*qf)[kMaxHeadDim], const scalar_t* kb, int64_t n, int64_t D, float (*s)[kMaxBlock]) {
  for (int64_t j = 0; j < n; ++j) {
    const scalar_t* kj = kb + j * D;
    __m256 a[NG], b[NG];  // two sums per head: halves the FMA chain
    for (int g = 0; g < NG; ++g) a[g] = b[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m256 k0 = load8(kj + d), k1 = load8(kj + d + 8);
      for (int g = 0; g < NG; ++g) {
        a[g] = _mm256_fmadd_ps(_mm256_load_ps(qf[g] + d), k0, a[g]);
        b[g] = _mm256_fmadd_ps(_mm256_load_ps(qf[g] + d + 8), k1, b[g]);
      }
    }
    for (int g = 0; g < NG; ++g) s[g][j] = hsum8(_mm256_add_ps(a[g], b[g]));
  }
}

// acc[g] += sum_j p[g][j] * v[j] for NG heads, 16 dimensions at a time: the 2 x NG slices are registers
// over the block's keys, loaded and stored once per block.
template <int NG, typename scalar_t>
inline void values_avx2(float (*acc)[kMaxHeadDim], const float (*p)[kMaxBlock], const scalar_t* vb, int64_t n,
                        int64_t D) {
  for (int64_t d = 0; d < D; d += 16) {
    __m256 r0[NG], r1[NG];
    for (int g = 0; g < NG; ++g) {
      r0[g] = _mm256_load_ps(acc[g] + d);
      r1[g] = _mm256_load_ps(acc[g] + d + 8);
    }
    for (int64_t j = 0; j < n; ++j) {
      const __m256 v0 = load8(vb + j * D + d), v1 = load8(vb + j * D + d + 8);
      for (int g = 0; g < NG; ++g) {
        const __m256 w = _mm256_broadcast_ss(p[g] + j);
        r0[g] = _mm256_fmadd_ps(w, v0, r0[g]);
        r1[g] = _mm256_fmadd_ps(w, v1, r1[g]);
      }
    }
    for (int g = 0; g < NG; ++g) {
      _mm256_store_ps(acc[g] + d, r0[g]);
      _mm256_store_ps(acc[g] + d + 8, r1[g]);
    }
  }
}

// The block steps for float32 and bfloat16 on AVX2 (D % 16 == 0): the G heads of a KV head in groups of up
// to 4 whose sums stay in registers over the block (the vector steps keep them in memory).
struct Avx2BlockSteps {
  template <typename scalar_t>
  void scores(const float (*qf)[kMaxHeadDim], const scalar_t* kb, int64_t n, int64_t G, int64_t, int64_t D,
              float (*s)[kMaxBlock]) const {
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      switch (std::min<int64_t>(4, G - g0)) {
        case 1: scores_avx2<1>(qf + g0, kb, n, D, s + g0); break;
        case 2: scores_avx2<2>(qf + g0, kb, n, D, s + g0); break;
        case 3: scores_avx2<3>(qf + g0, kb, n, D, s + g0); break;
        default: scores_avx2<4>(qf + g0, kb, n, D, s + g0); break;
      }
    }
  }
  template <typename scalar_t>
  void values(float (*acc)[kMaxHeadDim], const float (*s)[kMaxBlock], const scalar_t* vb, int64_t n, int64_t G,
              int64_t, int64_t D) const {
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      switch (std::min<int64_t>(4, G - g0)) {
        case 1: values_avx2<1>(acc + g0, s + g0, vb, n, D); break;
        case 2: values_avx2<2>(acc + g0, s + g0, vb, n, D); break;
        case 3: values_avx2<3>(acc + g0, s + g0, vb, n, D); break;
        default: values_avx2<4>(acc + g0, s + g0, vb, n, D); break;
      }
    }
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
