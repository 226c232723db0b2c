// The head_dim-64 attention paths of paged_attention_cpu.cpp on 8-lane AVX2 + FMA vectors, for x86 CPUs without
// AVX-512 (AMD Zen 1-3, Intel before Skylake-SP and its client parts), in float32 from a float32 or bfloat16 cache.
//   one_row_d64: one query row (decode). Keys in pieces copied out of the cache first; scores for eight keys at a
//                time per query head, their lane sums reduced together; softmax over the whole row; values in two
//                halves of 32 dimensions, so each head's sums stay in registers.
//   rows_gemm:   up to kGemmRows (192) query rows of one request over at most kGemmMaxKeys keys (prompt chunks,
//                speculative rows): each KV head's keys packed once, then 6 x 16 register tiles for the scores and
//                the output, each row's softmax whole.
//   rows_d64:    up to kRows (8) query rows of one request, flash-style (online softmax) with the rows in the lanes,
//                for rows over more keys than rows_gemm packs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "cpu_math.h"

namespace tallyserve_avx2 {

constexpr int64_t kRows = 8;  // query rows in the lanes of rows_d64
constexpr int64_t kKeysPerPiece = 256;
constexpr int64_t kRowPiece = 64;  // one_row_d64: keys per piece copied out of the cache

// One cached value as float32 (a float32 cache, or bfloat16 bits).
inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) {
  const uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// 8 cached values as float32 (a float32 cache, or bfloat16 bits).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// [sum(v[0]), ..., sum(v[7])]
inline __m256 hsum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// Softmax of n scores in place, in float32: max, exp, sum, scale (the tail past a multiple of 8 in scalar code).
inline void softmax_inplace(float* s, int64_t n) {
  const int64_t n8 = n / 8 * 8;
  float mx = s[0];
  if (n8) {
    __m256 m8 = _mm256_loadu_ps(s);
    for (int64_t j = 8; j < n8; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + j));
    mx = hmax(m8);
  }
  for (int64_t j = n8; j < n; ++j) mx = std::max(mx, s[j]);
  const __m256 mxv = _mm256_set1_ps(mx);
  __m256 sum8 = _mm256_setzero_ps();
  for (int64_t j = 0; j < n8; j += 8) {
    const __m256 e = tallyserve_cpu_math::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mxv));
    sum8 = _mm256_add_ps(sum8, e);
    _mm256_storeu_ps(s + j, e);
  }
  float sum = hsum(sum8);
  for (int64_t j = n8; j < n; ++j) {
    s[j] = tallyserve_cpu_math::exp_float(s[j] - mx);
    sum += s[j];
  }
  const float inv = 1.f / sum;
  const __m256 inv8 = _mm256_set1_ps(inv);
  for (int64_t j = 0; j < n8; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv8));
  for (int64_t j = n8; j < n; ++j) s[j] *= inv;
}

// The eight lane-partial products of query head qh (64 floats) with key row kr.
template <typename KvT>
inline __m256 dot64(const float* qh, const KvT* kr) {
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qh), load8(kr));
  for (int c = 1; c < 8; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c), load8(kr + 8 * c), acc);
  return acc;
}

// Rows [j0, j1) of KV heads [g_lo, g_lo + ng) from the paged cache into dst, side by side (rows of ng * 64).
template <typename KvT>
inline void copy_rows(KvT* dst, const KvT* src, const int64_t* row_off, int64_t j0, int64_t j1, int64_t g_lo,
                      int64_t ng) {
  const int64_t w = ng * 64;
  for (int64_t j = j0; j < j1; ++j) std::memcpy(dst + (j - j0) * w, src + row_off[j] + g_lo * 64, w * sizeof(KvT));
}

// One query row (decode), head_dim 64, KV head groups [g_lo, g_hi) of G (1 to 4) query heads each; as the 16-lane
// one_row_d64 (scores: (Hq * nkeys) scratch, row h's scores at h * nkeys). The keys go in pieces of kRowPiece:
// each piece's K rows (then, after the softmax, its V rows) are first copied from the cache into buf, a tight
// copy loop that keeps many cache misses in flight, and the arithmetic then reads them from L1 / L2. Reading the
// cache inside the arithmetic kept few misses in flight: on a 2-core Zen 3, W's decode steps of 64 sequences
// spent 58-64 ms per step in attention that way and 50-54 with the copies. Each score is one key's dot product,
// eight keys' lane sums reduced together (the keys past a multiple of 8 one at a time); each output sums its keys
// in order, so the pieces change no bit of the result.
template <int G, typename KvT>
void one_row_groups(const float* q, float* o, const KvT* K, const KvT* V, const int64_t* row_off, int64_t nkeys,
                    int64_t g_lo, int64_t g_hi, float sc, float* scores, KvT* buf) {
  const __m256 scale8 = _mm256_set1_ps(sc);
  const int64_t ng = g_hi - g_lo, w = ng * 64, n8 = nkeys / 8 * 8;
  for (int64_t p0 = 0; p0 < nkeys; p0 += kRowPiece) {
    const int64_t p1 = std::min(nkeys, p0 + kRowPiece);
    copy_rows(buf, K, row_off, p0, p1, g_lo, ng);
    for (int64_t j0 = p0; j0 + 8 <= std::min(p1, n8); j0 += 8) {
      const KvT* kr = buf + (j0 - p0) * w;
      for (int64_t g = 0; g < ng; ++g)
        for (int a = 0; a < G; ++a) {
          const int64_t h = (g_lo + g) * G + a;
          const float* qh = q + h * 64;
          __m256 part[8];
          for (int u = 0; u < 8; ++u) part[u] = dot64(qh, kr + u * w + g * 64);
          _mm256_storeu_ps(scores + h * nkeys + j0, _mm256_mul_ps(hsum8(part), scale8));
        }
    }
    for (int64_t j = std::max(p0, n8); j < p1; ++j)
      for (int64_t g = 0; g < ng; ++g)
        for (int a = 0; a < G; ++a) {
          const int64_t h = (g_lo + g) * G + a;
          scores[h * nkeys + j] = hsum(dot64(q + h * 64, buf + (j - p0) * w + g * 64)) * sc;
        }
  }
  for (int64_t h = g_lo * G; h < g_hi * G; ++h) softmax_inplace(scores + h * nkeys, nkeys);
  // values: per group and half of the dimensions (32), each head's sums in registers over a piece, kept in o
  // between pieces
  for (int64_t h = g_lo * G; h < g_hi * G; ++h) std::memset(o + h * 64, 0, 64 * sizeof(float));
  for (int64_t p0 = 0; p0 < nkeys; p0 += kRowPiece) {
    const int64_t p1 = std::min(nkeys, p0 + kRowPiece);
    copy_rows(buf, V, row_off, p0, p1, g_lo, ng);
    for (int64_t g = 0; g < ng; ++g)
      for (int half = 0; half < 2; ++half) {
        __m256 acc[G][4];
        float* ob = o + (g_lo + g) * G * 64 + half * 32;
        for (int a = 0; a < G; ++a)
          for (int c = 0; c < 4; ++c) acc[a][c] = _mm256_loadu_ps(ob + a * 64 + c * 8);
        const float* sg = scores + (g_lo + g) * G * nkeys;
        for (int64_t j = p0; j < p1; ++j) {
          const KvT* vr = buf + (j - p0) * w + g * 64 + half * 32;
          const __m256 v0 = load8(vr), v1 = load8(vr + 8), v2 = load8(vr + 16), v3 = load8(vr + 24);
          for (int a = 0; a < G; ++a) {
            const __m256 p = _mm256_broadcast_ss(sg + a * nkeys + j);
            acc[a][0] = _mm256_fmadd_ps(p, v0, acc[a][0]);
            acc[a][1] = _mm256_fmadd_ps(p, v1, acc[a][1]);
            acc[a][2] = _mm256_fmadd_ps(p, v2, acc[a][2]);
            acc[a][3] = _mm256_fmadd_ps(p, v3, acc[a][3]);
          }
        }
        for (int a = 0; a < G; ++a)
          for (int c = 0; c < 4; ++c) _mm256_storeu_ps(ob + a * 64 + c * 8, acc[a][c]);
      }
  }
}

// buf: kRowPiece * Hkv * 64 values of scratch
template <typename KvT>
void one_row_d64(const float* q, float* o, const KvT* K, const KvT* V, const int64_t* row_off, int64_t nkeys,
                 int64_t h_lo, int64_t h_hi, int64_t G, float sc, float* scores, KvT* buf) {
  const int64_t g_lo = h_lo / G, g_hi = h_hi / G;
  switch (G) {
    case 1: one_row_groups<1>(q, o, K, V, row_off, nkeys, g_lo, g_hi, sc, scores, buf); break;
    case 2: one_row_groups<2>(q, o, K, V, row_off, nkeys, g_lo, g_hi, sc, scores, buf); break;
    case 3: one_row_groups<3>(q, o, K, V, row_off, nkeys, g_lo, g_hi, sc, scores, buf); break;
    default: one_row_groups<4>(q, o, K, V, row_off, nkeys, g_lo, g_hi, sc, scores, buf); break;
  }
}

// Up to kRows query rows of one request at positions first .. first + nrow - 1 (a chunk, or speculative rows),
// head_dim 64, query heads [h_lo, h_hi) in groups of G: the 16-lane rows_d64 with eight rows in the lanes. Keys in
// pieces of kKeysPerPiece copied as float32 into kc / vc (rows of 64, padded to 8 keys); per query head q
// transposed into qt (64 x 8), the output in ot (64 x 8), the running max and sum in stats (16 per head).
// Row i sees keys 0 .. first + i; lanes past nrow repeat the last row and are not stored.
template <typename KvT>
void rows_d64(const float* q, int64_t q_row, float* o, int64_t o_row, const KvT* K, const KvT* V,
              const int64_t* row_off, int64_t nrow, int64_t first, int64_t h_lo, int64_t h_hi, int64_t G, float sc,
              float* kc, float* vc, float* qt, float* ot, float* stats) {
  const int64_t nkeys = first + nrow;
  const __m256i pos = _mm256_add_epi32(
      _mm256_set1_epi32(static_cast<int32_t>(first)),
      _mm256_min_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int32_t>(nrow - 1))));
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  const __m256 scale8 = _mm256_set1_ps(sc);
  for (int64_t g = h_lo / G; g < h_hi / G; ++g) {
    for (int64_t a = 0; a < G; ++a) {  // q transposed, output and running max / sum cleared
      float* qa = qt + a * 512;
      for (int64_t i = 0; i < kRows; ++i) {
        const float* qr = q + std::min(i, nrow - 1) * q_row + (g * G + a) * 64;
        for (int64_t d = 0; d < 64; ++d) qa[d * 8 + i] = qr[d];
      }
      std::memset(ot + a * 512, 0, sizeof(float) * 512);
      _mm256_storeu_ps(stats + a * 16, neg_inf);
      _mm256_storeu_ps(stats + a * 16 + 8, _mm256_setzero_ps());
    }
    for (int64_t c0 = 0; c0 < nkeys; c0 += kKeysPerPiece) {
      const int64_t cn = std::min(kKeysPerPiece, nkeys - c0), padded = (cn + 7) / 8 * 8;
      for (int64_t j = 0; j < cn; ++j) {
        const KvT* kr = K + row_off[c0 + j] + g * 64;
        const KvT* vr = V + row_off[c0 + j] + g * 64;
        for (int c = 0; c < 8; ++c) {
          _mm256_storeu_ps(kc + j * 64 + c * 8, load8(kr + c * 8));
          _mm256_storeu_ps(vc + j * 64 + c * 8, load8(vr + c * 8));
        }
      }
      std::memset(kc + cn * 64, 0, sizeof(float) * (padded - cn) * 64);
      std::memset(vc + cn * 64, 0, sizeof(float) * (padded - cn) * 64);
      for (int64_t a = 0; a < G; ++a) {
        const float* qa = qt + a * 512;
        float* oa = ot + a * 512;
        __m256 m = _mm256_loadu_ps(stats + a * 16), l = _mm256_loadu_ps(stats + a * 16 + 8);
        for (int64_t jb = 0; jb < padded; jb += 8) {
          __m256 s[8];
          for (int u = 0; u < 8; ++u) s[u] = _mm256_setzero_ps();
          for (int64_t d = 0; d < 64; ++d) {
            const __m256 qd = _mm256_loadu_ps(qa + d * 8);
            const float* kd = kc + jb * 64 + d;
            for (int u = 0; u < 8; ++u) s[u] = _mm256_fmadd_ps(qd, _mm256_broadcast_ss(kd + u * 64), s[u]);
          }
          __m256 invalid[8];
          __m256 top = m;
          for (int u = 0; u < 8; ++u) {  // key c0 + jb + u: invalid in the lanes whose position is before it
            invalid[u] = _mm256_castsi256_ps(
                _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(c0 + jb + u)), pos));
            s[u] = _mm256_blendv_ps(_mm256_mul_ps(s[u], scale8), neg_inf, invalid[u]);
            top = _mm256_max_ps(top, s[u]);
          }
          // lanes with no key yet (m = -inf) start from zero; key 0 is valid in every lane, so top is finite
          const __m256 corr = _mm256_and_ps(_mm256_cmp_ps(m, neg_inf, _CMP_NEQ_OQ),
                                            tallyserve_cpu_math::exp8(_mm256_sub_ps(m, top)));
          m = top;
          __m256 p[8];
          l = _mm256_mul_ps(l, corr);
          for (int u = 0; u < 8; ++u) {
            p[u] = _mm256_andnot_ps(invalid[u], tallyserve_cpu_math::exp8(_mm256_sub_ps(s[u], top)));
            l = _mm256_add_ps(l, p[u]);
          }
          for (int64_t d = 0; d < 64; ++d) {
            const float* vd = vc + jb * 64 + d;
            __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(oa + d * 8), corr);
            for (int u = 0; u < 8; ++u) acc = _mm256_fmadd_ps(p[u], _mm256_broadcast_ss(vd + u * 64), acc);
            _mm256_storeu_ps(oa + d * 8, acc);
          }
        }
        _mm256_storeu_ps(stats + a * 16, m);
        _mm256_storeu_ps(stats + a * 16 + 8, l);
      }
    }
    for (int64_t a = 0; a < G; ++a) {  // divide by the sums, rows back out of the lanes
      const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_loadu_ps(stats + a * 16 + 8));
      float* oa = ot + a * 512;
      for (int64_t d = 0; d < 64; ++d) _mm256_storeu_ps(oa + d * 8, _mm256_mul_ps(_mm256_loadu_ps(oa + d * 8), inv));
      for (int64_t i = 0; i < nrow; ++i) {
        float* orow = o + i * o_row + (g * G + a) * 64;
        for (int64_t d = 0; d < 64; ++d) orow[d] = oa[d * 8 + i];
      }
    }
  }
}

// ---- query rows of a prompt chunk as small matrix products (rows_gemm) ----
// Up to kGemmRows query rows of one request over at most kGemmMaxKeys keys, head_dim 64, query heads [h_lo, h_hi)
// in groups of G. Per KV head: its keys packed once as 16-key panels of K transposed (kt) and its values as rows
// (vr), both float32, for every query head and row of the item. Then per query head, six rows at a time: the
// scores of each 16-key panel as one 6 x 16 register tile over the 64 dimensions (the product kernel's tile: one
// broadcast of six q values and two panel loads per dimension), the softmax of each row over its keys whole (as the
// decode row: max, exp, sum, scale), and the output in 6 x 16 tiles over the keys. Row i (position first + i)
// sees keys 0 .. first + i. The 8-row flash path (rows_d64) reads its keys with one broadcast per multiply: on a
// 2-core Zen 3, 16 prompts of 512 tokens (9 heads, 3 KV heads) took 58-62 ms there and 37 ms here, and W's prompt
// attention 2.16 -> 1.36 s.
constexpr int64_t kGemmRows = 192;
constexpr int64_t kGemmMaxKeys = 4096;

// r[i] (8 floats each) -> column i of the 8 x 8 block: after it, r[d] holds element d of every input row.
inline void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

template <typename KvT>
void pack_head(const KvT* K, const KvT* V, const int64_t* row_off, int64_t n, int64_t g, float* kt, float* vr) {
  const int64_t panels = (n + 15) / 16;
  for (int64_t p = 0; p < panels; ++p) {
    float* dst = kt + p * 64 * 16;
    const int64_t cnt = std::min<int64_t>(16, n - p * 16);
    if (cnt == 16) {  // whole panels: 8 x 8 blocks transposed in registers
      for (int64_t half = 0; half < 2; ++half)
        for (int64_t d0 = 0; d0 < 64; d0 += 8) {
          __m256 r[8];
          for (int u = 0; u < 8; ++u) r[u] = load8(K + row_off[p * 16 + half * 8 + u] + g * 64 + d0);
          transpose8(r);
          for (int d = 0; d < 8; ++d) _mm256_storeu_ps(dst + (d0 + d) * 16 + half * 8, r[d]);
        }
      continue;
    }
    for (int64_t u = 0; u < cnt; ++u) {
      const KvT* kr = K + row_off[p * 16 + u] + g * 64;
      for (int64_t d = 0; d < 64; ++d) dst[d * 16 + u] = static_cast<float>(load1(kr + d));
    }
    for (int64_t u = cnt; u < 16; ++u)
      for (int64_t d = 0; d < 64; ++d) dst[d * 16 + u] = 0.f;
  }
  for (int64_t j = 0; j < n; ++j) {
    const KvT* src = V + row_off[j] + g * 64;
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(vr + j * 64 + c * 8, load8(src + c * 8));
  }
}

// c[r][0:16] (c0[r], c1[r]) = sum over k < kn of A[r * lda + k] * B[k * ldb + 0:16], for R (1 to 6) rows: the
// register tile of both of gemm_block's products (one broadcast of R values and two loads of B per k).
template <int R>
inline void tile16(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t kn, __m256* c0, __m256* c1) {
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int64_t k = 0; k < kn; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb), b1 = _mm256_loadu_ps(B + k * ldb + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(A + r * lda + k);
      c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
    }
  }
}

// R (1 to 6) rows of one query head: q rows q_row apart (the head's 64 values at q), output rows o_row apart;
// row r sees keys 0 .. last0 + r; kt / vr from pack_head; sc: R rows of ld scratch scores.
template <int R>
void gemm_block(const float* q, int64_t q_row, float* o, int64_t o_row, const float* kt, const float* vr,
                int64_t last0, float scale, float* sc, int64_t ld) {
  const int64_t n = last0 + R;  // keys the block's last row sees
  const int64_t panels = (n + 15) / 16;
  const __m256 scale8 = _mm256_set1_ps(scale);
  for (int64_t p = 0; p < panels; ++p) {
    __m256 c0[R], c1[R];
    tile16<R>(q, q_row, kt + p * 64 * 16, 16, 64, c0, c1);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(sc + r * ld + p * 16, _mm256_mul_ps(c0[r], scale8));
      _mm256_storeu_ps(sc + r * ld + p * 16 + 8, _mm256_mul_ps(c1[r], scale8));
    }
  }
  for (int r = 0; r < R; ++r) {  // each row's softmax over its own keys; the keys past them weigh 0
    float* sr = sc + r * ld;
    softmax_inplace(sr, last0 + r + 1);
    for (int64_t j = last0 + r + 1; j < n; ++j) sr[j] = 0.f;
  }
  for (int64_t c = 0; c < 4; ++c) {  // output dimensions 16 at a time, the sums over every key in registers
    __m256 a0[R], a1[R];
    tile16<R>(sc, ld, vr + c * 16, 64, n, a0, a1);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(o + r * o_row + c * 16, a0[r]);
      _mm256_storeu_ps(o + r * o_row + c * 16 + 8, a1[r]);
    }
  }
}

// nrow (up to kGemmRows) rows of one request at positions first .. first + nrow - 1, over first + nrow keys (at
// most kGemmMaxKeys). kt, vr: 64 * 16 * ceil(keys / 16) floats each; sc: 6 * 16 * ceil(keys / 16) floats.
template <typename KvT>
void rows_gemm(const float* q, int64_t q_row, float* o, int64_t o_row, const KvT* K, const KvT* V,
               const int64_t* row_off, int64_t nrow, int64_t first, int64_t h_lo, int64_t h_hi, int64_t G, float sc,
               float* kt, float* vr, float* scores) {
  const int64_t nkeys = first + nrow, ld = (nkeys + 15) / 16 * 16;
  for (int64_t g = h_lo / G; g < h_hi / G; ++g) {
    pack_head(K, V, row_off, nkeys, g, kt, vr);
    for (int64_t h = g * G; h < (g + 1) * G; ++h)
      for (int64_t i = 0; i < nrow; i += 6) {
        const float* qb = q + i * q_row + h * 64;
        float* ob = o + i * o_row + h * 64;
        switch (std::min<int64_t>(6, nrow - i)) {
          case 6: gemm_block<6>(qb, q_row, ob, o_row, kt, vr, first + i, sc, scores, ld); break;
          case 5: gemm_block<5>(qb, q_row, ob, o_row, kt, vr, first + i, sc, scores, ld); break;
          case 4: gemm_block<4>(qb, q_row, ob, o_row, kt, vr, first + i, sc, scores, ld); break;
          case 3: gemm_block<3>(qb, q_row, ob, o_row, kt, vr, first + i, sc, scores, ld); break;
          case 2: gemm_block<2>(qb, q_row, ob, o_row, kt, vr, first + i, sc, scores, ld); break;
          default: gemm_block<1>(qb, q_row, ob, o_row, kt, vr, first + i, sc, scores, ld); break;
        }
      }
  }
}

}  // namespace tallyserve_avx2

#endif
