// The head_dim-64 attention paths of paged_attention_cpu.cpp on 8-lane AVX2 + FMA vectors, for x86 CPUs without
// AVX-512 (AMD Zen 1-3, Intel before Skylake-SP and its client parts): the same two kernels and the same arithmetic
// as the 16-lane ones, in float32 from a float32 or bfloat16 cache.
//   one_row_d64: one query row (decode). Keys in pieces copied out of the cache first; scores for eight keys at a
//                time per query head, their lane sums reduced together; softmax over the whole row; values in two
//                halves of 32 dimensions, so each head's sums stay in registers.
//   rows_d64:    up to kRows (8) query rows of one request, flash-style (online softmax) with the rows in the lanes.
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

}  // namespace tallyserve_avx2

#endif
