// Causal attention of bf16 prefill chunks in query tiles on AVX512-BF16: model/tile_attention.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define SESSIONSERVE_BF16_TILES 1
#endif

namespace {

#ifdef SESSIONSERVE_BF16_TILES

constexpr int kTileKeys = 64;    // keys per block: 4 vectors of 16 scores per row
constexpr int kTileQueries = 32; // query tokens per task (times the heads of a GQA group)
constexpr int64_t kMaxPackBytes = 64 << 20;  // packed keys and values per group of sequences

// Keys and values of one task, read through either the chunk's own rows or a block table.
struct KvSource {
  const uint16_t* k;  // key 0's head vector (flat rows) or the cache's start (paged)
  const uint16_t* v;
  int64_t k_stride, v_stride;  // flat rows: elements from one token's K (V) to the next
  const int32_t* table;        // paged: this sequence's block ids (nullptr for flat rows)
  int64_t block_size, block_stride, head_offset, dim;
  inline int64_t paged_offset(int64_t j) const {
    return static_cast<int64_t>(table[j / block_size]) * block_stride + head_offset + (j % block_size) * dim;
  }
  inline const uint16_t* key(int64_t j) const { return table ? k + paged_offset(j) : k + j * k_stride; }
  inline const uint16_t* value(int64_t j) const { return table ? v + paged_offset(j) : v + j * v_stride; }
};

inline float hmax(__m512 v) { return _mm512_reduce_max_ps(v); }

// exp(x) for x <= 0, float32, 16 lanes (same polynomial as the paged kernel's vexp).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 nf = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(nf, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(nf, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, nf);
}

// S[r][0..64) = scale * q_r . k_j for rows r0..r0+RB; q rows are pairs of bf16 (uint32), kp is the
// key block in VNNI order: kp[c][dp] is 16 keys' (d=2dp, 2dp+1) pairs for key chunk c.
template <int RB>
inline void qk_rows(const uint32_t* q, int64_t D2, const __m512bh* kp, float* s, float scale) {
  __m512 acc[RB][4];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t dp = 0; dp < D2; ++dp) {
    const __m512bh k0 = kp[0 * D2 + dp], k1 = kp[1 * D2 + dp], k2 = kp[2 * D2 + dp], k3 = kp[3 * D2 + dp];
    for (int r = 0; r < RB; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * D2 + dp]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qb, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qb, k1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], qb, k2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], qb, k3);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kTileKeys + c * 16, _mm512_mul_ps(acc[r][c], sc));
}

// O[r] = O[r] * corr[r] + P[r] V for rows r0..r0+RB; p rows are kTileKeys/2 bf16 pairs; vp is the value
// block in VNNI order: vp[jp][dc] is 16 dims' (key 2jp, 2jp+1) pairs for dim chunk dc. DC <= 16 chunks.
template <int RB>
inline void pv_rows(const uint32_t* p, const __m512bh* vp, int64_t DC, float* o, int64_t D, const float* corr) {
  for (int64_t dc0 = 0; dc0 < DC; dc0 += 4) {
    const int64_t nc = std::min<int64_t>(4, DC - dc0);
    __m512 acc[RB][4];
    for (int r = 0; r < RB; ++r) {
      const __m512 cr = _mm512_set1_ps(corr[r]);
      for (int c = 0; c < 4; ++c)
        acc[r][c] = c < nc ? _mm512_mul_ps(_mm512_loadu_ps(o + r * D + (dc0 + c) * 16), cr) : _mm512_setzero_ps();
    }
    for (int64_t jp = 0; jp < kTileKeys / 2; ++jp) {
      const __m512bh* vrow = vp + jp * DC + dc0;
      for (int r = 0; r < RB; ++r) {
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[r * (kTileKeys / 2) + jp]));
        for (int c = 0; c < 4; ++c)
          if (c < nc) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, vrow[c]);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < nc; ++c) _mm512_storeu_ps(o + r * D + (dc0 + c) * 16, acc[r][c]);
  }
}

// Repack key block b (keys 64b .. 64b + 63) of one (sequence, KV head): keys as [chunk][d pair][16 keys]
// and values as [key pair][dim chunk][16 dims], both as pairs of bf16; zero past the last key.
void pack_block(const KvSource& kv, int64_t D, int64_t b, int64_t num_keys, __m512bh* kout, __m512bh* vout) {
  const int64_t D2 = D / 2, DC = D / 16, j0 = b * kTileKeys;
  const int64_t nk = std::min<int64_t>(kTileKeys, num_keys - j0);
  uint32_t* kw = reinterpret_cast<uint32_t*>(kout);
  uint16_t* vw = reinterpret_cast<uint16_t*>(vout);
  for (int64_t j = 0; j < kTileKeys; ++j) {
    const int64_t c = j / 16, jj = j % 16, jp = j / 2, odd = j % 2;
    if (j < nk) {
      const uint32_t* krow = reinterpret_cast<const uint32_t*>(kv.key(j0 + j));
      const uint16_t* vrow = kv.value(j0 + j);
      for (int64_t dp = 0; dp < D2; ++dp) kw[(c * D2 + dp) * 16 + jj] = krow[dp];
      for (int64_t d = 0; d < D; ++d) vw[((jp * DC + d / 16) * 16 + d % 16) * 2 + odd] = vrow[d];
    } else {
      for (int64_t dp = 0; dp < D2; ++dp) kw[(c * D2 + dp) * 16 + jj] = 0;
      for (int64_t d = 0; d < D; ++d) vw[((jp * DC + d / 16) * 16 + d % 16) * 2 + odd] = 0;
    }
  }
}

// One task: query tokens [i0, i0 + n) of a sequence (rows of q from q_row0, absolute positions from
// pos0 + i0) and the G query heads of KV head kh, over keys [0, pos0 + i0 + n), whose packed blocks
// start at kpack / vpack, one every pack_stride vectors.
void tile_task(const uint16_t* q, int64_t q_stride, uint16_t* out, int64_t out_stride, int64_t G, int64_t D, int64_t kh,
               int64_t q_row0, int64_t i0, int64_t n, int64_t pos0, const __m512bh* kpack,
               const __m512bh* vpack, int64_t pack_stride, float scale, std::vector<uint32_t>& qbuf, std::vector<float>& sbuf,
               std::vector<uint32_t>& pbuf, std::vector<float>& obuf, std::vector<float>& mbuf,
               std::vector<float>& lbuf, std::vector<float>& cbuf) {
  const int64_t R = n * G, D2 = D / 2, DC = D / 16;
  // Rows are (token, head) token-major: row r = i * G + g.
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < G; ++g)
      std::memcpy(&qbuf[(i * G + g) * D2], q + (q_row0 + i0 + i) * q_stride + (kh * G + g) * D, D * sizeof(uint16_t));
  std::fill(obuf.begin(), obuf.begin() + R * D, 0.f);
  std::fill(mbuf.begin(), mbuf.begin() + R, -std::numeric_limits<float>::infinity());
  std::fill(lbuf.begin(), lbuf.begin() + R, 0.f);
  const int64_t kv_end = pos0 + i0 + n;
  const int64_t first_pos = pos0 + i0;
  for (int64_t j0 = 0; j0 < kv_end; j0 += kTileKeys) {
    const __m512bh* kb = kpack + (j0 / kTileKeys) * pack_stride;
    const __m512bh* vb = vpack + (j0 / kTileKeys) * pack_stride;
    const int64_t nk = std::min<int64_t>(kTileKeys, kv_end - j0);
    // Scores for all rows, 4 at a time.
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) qk_rows<4>(&qbuf[r * D2], D2, kb, &sbuf[r * kTileKeys], scale);
    for (; r < R; ++r) qk_rows<1>(&qbuf[r * D2], D2, kb, &sbuf[r * kTileKeys], scale);
    // Mask, online softmax, P in bf16.
    for (r = 0; r < R; ++r) {
      float* s = &sbuf[r * kTileKeys];
      const int64_t visible = std::min<int64_t>(nk, first_pos + r / G + 1 - j0);  // keys j0..j0+visible
      if (visible < kTileKeys)
        for (int64_t j = std::max<int64_t>(visible, 0); j < kTileKeys; ++j) s[j] = -std::numeric_limits<float>::infinity();
      __m512 v[4];
      for (int c = 0; c < 4; ++c) v[c] = _mm512_loadu_ps(s + c * 16);
      const float bmax = hmax(_mm512_max_ps(_mm512_max_ps(v[0], v[1]), _mm512_max_ps(v[2], v[3])));
      const float m_new = std::max(mbuf[r], bmax);
      const float corr = std::exp(mbuf[r] - m_new);  // exp(-inf) = 0 on the first block
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        v[c] = exp16(_mm512_sub_ps(v[c], mv));
        sum = _mm512_add_ps(sum, v[c]);
      }
      // lanes of masked keys hold exp(-87) ~ 1e-38: far below float resolution of l; their V is real
      // (or zero past the last key), so their share of O is as negligible.
      lbuf[r] = lbuf[r] * corr + _mm512_reduce_add_ps(sum);
      mbuf[r] = m_new;
      cbuf[r] = corr;
      uint32_t* prow = &pbuf[r * (kTileKeys / 2)];
      _mm512_storeu_si512(prow, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
      _mm512_storeu_si512(prow + 16, (__m512i)_mm512_cvtne2ps_pbh(v[3], v[2]));
    }
    for (r = 0; r + 4 <= R; r += 4)
      pv_rows<4>(&pbuf[r * (kTileKeys / 2)], vb, DC, &obuf[r * D], D, &cbuf[r]);
    for (; r < R; ++r) pv_rows<1>(&pbuf[r * (kTileKeys / 2)], vb, DC, &obuf[r * D], D, &cbuf[r]);
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      const float inv = 1.f / lbuf[r];
      uint16_t* o = out + (q_row0 + i0 + i) * out_stride + (kh * G + g) * D;
      for (int64_t dc = 0; dc < DC; ++dc) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(&obuf[r * D + dc * 16]), _mm512_set1_ps(inv));
        const __m256bh y = _mm512_cvtneps_pbh(x);
        std::memcpy(o + dc * 16, &y, sizeof(y));
      }
    }
}

#endif  // SESSIONSERVE_BF16_TILES

bool tile_attention_available() {
#ifdef SESSIONSERVE_BF16_TILES
  return true;
#else
  return false;
#endif
}

// out, q: (T, H, D) bf16. Sequence s owns q rows [q_start[s], q_start[s] + q_len[s]); its first query
// sits at position pos0[s]. Without a block table, k and v are (T, Hkv, D) rows of the same flat batch
// and sequence s's key j is row q_start[s] + j (a fresh prefill: pos0 = 0). With one, k and v are the
// paged caches (NB, Hkv, BS, D) and key j lives in block block_tables[s][j / BS].
void tile_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& pos0,
                     const at::Tensor& block_tables, double scale) {
#ifdef SESSIONSERVE_BF16_TILES
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "bfloat16 only");
  const bool paged = block_tables.numel() > 0;
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && k.dim() == (paged ? 4 : 3) && v.sizes() == k.sizes(),
              "q, out: (T, H, D); k, v: (T, Hkv, D) rows or (NB, Hkv, BS, D) caches");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &out, &k, &v})  // rows may be strided (q, k, v are views of one projection)
    TORCH_CHECK(t->stride(-1) == 1 && t->stride(-2) == t->size(-1), "heads must be dense within a row");
  TORCH_CHECK(!paged || (k.is_contiguous() && v.is_contiguous()), "contiguous caches");
  const int64_t H = q.size(1), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(D % 32 == 0 && D <= 256 && H % Hkv == 0, "head size must be a multiple of 32 and at most 256");
  const int64_t G = H / Hkv;
  const auto starts = q_start.to(at::kLong).contiguous();
  const auto lens = q_len.to(at::kLong).contiguous();
  const auto firsts = pos0.to(at::kLong).contiguous();
  const auto tables = paged ? block_tables.to(at::kInt).contiguous() : block_tables;
  const int64_t S = starts.numel();
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  const int64_t* p0 = firsts.data_ptr<int64_t>();
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int32_t* tb = paged ? tables.data_ptr<int32_t>() : nullptr;
  const int64_t MB = paged ? tables.size(1) : 0;
  const int64_t BS = paged ? k.size(2) : 1;
  const float sc = static_cast<float>(scale);
  auto source = [&](int64_t s, int64_t kh) {
    KvSource src;
    src.dim = D;
    if (paged) {
      src.k = kp;
      src.v = vp;
      src.table = tb + s * MB;
      src.block_size = BS;
      src.block_stride = Hkv * BS * D;
      src.head_offset = kh * BS * D;
      src.k_stride = src.v_stride = 0;
    } else {
      src.k = kp + st[s] * k.stride(0) + kh * D;
      src.v = vp + st[s] * v.stride(0) + kh * D;
      src.table = nullptr;
      src.k_stride = k.stride(0);
      src.v_stride = v.stride(0);
      src.head_offset = src.block_size = src.block_stride = 0;
    }
    return src;
  };
  // Work units are (sequence, KV head) pairs, taken in groups whose packed keys and values stay under
  // kMaxPackBytes (one unit alone may exceed it): long contexts do not make one huge buffer.
  const int64_t block_vecs = kTileKeys * D / 32;
  const int64_t unit_bytes_per_block = 2 * block_vecs * static_cast<int64_t>(sizeof(__m512bh));
  auto num_blocks = [&](int64_t s) { return (p0[s] + ln[s] + kTileKeys - 1) / kTileKeys; };
  std::vector<__m512bh> kpack, vpack;
  for (int64_t u0 = 0; u0 < S * Hkv;) {
    int64_t u1 = u0, group_blocks = 0;
    while (u1 < S * Hkv && (u1 == u0 || (group_blocks + num_blocks(u1 / Hkv)) * unit_bytes_per_block <= kMaxPackBytes))
      group_blocks += num_blocks(u1++ / Hkv);
    // Pack every key block of the group's units once: (unit, block).
    std::vector<int64_t> unit_base(u1 - u0 + 1, 0), pack_unit;
    for (int64_t u = u0; u < u1; ++u) {
      unit_base[u - u0 + 1] = unit_base[u - u0] + num_blocks(u / Hkv);
      for (int64_t b = 0; b < num_blocks(u / Hkv); ++b) pack_unit.push_back(u);
    }
    kpack.resize(group_blocks * block_vecs);
    vpack.resize(group_blocks * block_vecs);
    at::parallel_for(0, group_blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t gb = begin; gb < end; ++gb) {
        const int64_t u = pack_unit[gb], s = u / Hkv, kh = u % Hkv;
        pack_block(source(s, kh), D, gb - unit_base[u - u0], p0[s] + ln[s], &kpack[gb * block_vecs],
                   &vpack[gb * block_vecs]);
      }
    });
    // Tiles: (unit, query tile).
    std::vector<int64_t> task_unit, task_i0;
    for (int64_t u = u0; u < u1; ++u)
      for (int64_t i0 = 0; i0 < ln[u / Hkv]; i0 += kTileQueries) {
        task_unit.push_back(u);
        task_i0.push_back(i0);
      }
    at::parallel_for(0, static_cast<int64_t>(task_unit.size()), 1, [&](int64_t begin, int64_t end) {
      const int64_t R = kTileQueries * G;
      std::vector<uint32_t> qbuf(R * D / 2), pbuf(R * kTileKeys / 2);
      std::vector<float> sbuf(R * kTileKeys), obuf(R * D), mbuf(R), lbuf(R), cbuf(R);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t u = task_unit[task], s = u / Hkv, kh = u % Hkv, i0 = task_i0[task];
        const int64_t n = std::min<int64_t>(kTileQueries, ln[s] - i0);
        const int64_t at = unit_base[u - u0] * block_vecs;
        tile_task(qp, q.stride(0), op, out.stride(0), G, D, kh, st[s], i0, n, p0[s], &kpack[at], &vpack[at],
                  block_vecs, sc, qbuf, sbuf, pbuf, obuf, mbuf, lbuf, cbuf);
      }
    });
    u0 = u1;
  }
#else
  TORCH_CHECK(false, "this build has no AVX512-BF16 tiles");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sessionserve_kernels, m) {
  m.def("tile_attention_available() -> bool", &tile_attention_available);
  m.def("tile_attention_(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor q_start, Tensor q_len, "
        "Tensor pos0, Tensor block_tables, float scale) -> ()");
  m.impl("tile_attention_", c10::DispatchKey::CPU, TORCH_FN(tile_attention_));
}
