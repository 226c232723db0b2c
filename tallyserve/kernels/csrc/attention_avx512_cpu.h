// The head_dim-64 attention paths of paged_attention_cpu.cpp on 16-lane AVX-512 vectors, in float32 from a float32
// or bfloat16 cache (empty stubs, and kBuilt false, in a build without AVX-512).
//   one_row_d64: one query row (decode), scores kept whole per query head.
//   rows_d64:    up to 16 query rows of one request, flash-style (online softmax) with the rows in the lanes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention_vec_cpu.h"
#include "cpu_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tallyserve_avx512 {

using namespace tallyserve_attention_vec;

constexpr int64_t kKeysPerPiece = 256;  // rows_d64: keys per piece of float32 scratch

#if defined(__AVX512F__)
constexpr bool kBuilt = true;

// One query row (decode), head_dim 64, query heads [h_lo, h_hi) in groups of G <= 4 sharing a KV head.
// Scores: eight keys at a time per query head, their lane sums reduced together (one reduction of eight
// vectors instead of eight full horizontal sums: the shuffles were the bottleneck). Values: each value row
// of a group is loaded into registers once for all its query heads, the sums stay in registers across the
// keys. scores: (Hq * nkeys) scratch, indexed as the generic path.
template <typename KvT>
void one_row_d64(const float* q, float* o, const KvT* K, const KvT* V, const int64_t* row_off, int64_t nkeys,
                 int64_t Hq, int64_t h_lo, int64_t h_hi, int64_t G, float sc, float* scores) {
  const __m256 scale8 = _mm256_set1_ps(sc);
  for (int64_t g = h_lo / G; g < h_hi / G; ++g) {
    const int64_t h0 = g * G;
    const KvT* Kg = K + g * 64;
    int64_t j0 = 0;
    for (; j0 + 8 <= nkeys; j0 += 8) {
      const KvT* kr[8];
      for (int u = 0; u < 8; ++u) {
        const int64_t j = j0 + u;
        kr[u] = Kg + row_off[j];
        // the rows two blocks of keys ahead (a cache block's rows are scattered over the pool)
        if (j + 16 < nkeys) prefetch_row(Kg + row_off[j + 16]);
      }
      for (int64_t a = 0; a < G; ++a) {
        const float* qh = q + (h0 + a) * 64;
        const __m512 qv[4] = {_mm512_loadu_ps(qh), _mm512_loadu_ps(qh + 16), _mm512_loadu_ps(qh + 32),
                              _mm512_loadu_ps(qh + 48)};
        __m256 part[8];
        for (int u = 0; u < 8; ++u) part[u] = dot64_half(qv, kr[u]);
        _mm256_storeu_ps(scores + (h0 + a) * nkeys + j0, _mm256_mul_ps(hsum8(part), scale8));
      }
    }
    for (int64_t a = 0; a < G; ++a) {
      const float* qh = q + (h0 + a) * 64;
      const __m512 qv[4] = {_mm512_loadu_ps(qh), _mm512_loadu_ps(qh + 16), _mm512_loadu_ps(qh + 32),
                            _mm512_loadu_ps(qh + 48)};
      for (int64_t j = j0; j < nkeys; ++j) {
        const KvT* kr = Kg + row_off[j];
        scores[(h0 + a) * nkeys + j] = _mm512_reduce_add_ps(dot64(qv, kr)) * sc;
      }
    }
    for (int64_t a = 0; a < G; ++a) softmax_inplace(scores + (h0 + a) * nkeys, nkeys);
    __m512 acc[4][4];
    for (int64_t a = 0; a < G; ++a)
      for (int c = 0; c < 4; ++c) acc[a][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nkeys; ++j) {
      const KvT* vr = V + row_off[j] + g * 64;
      if (j + 8 < nkeys) prefetch_row(V + row_off[j + 8] + g * 64);
      const __m512 v0 = load16(vr), v1 = load16(vr + 16), v2 = load16(vr + 32), v3 = load16(vr + 48);
      for (int64_t a = 0; a < G; ++a) {
        const __m512 p = _mm512_set1_ps(scores[(h0 + a) * nkeys + j]);
        acc[a][0] = _mm512_fmadd_ps(p, v0, acc[a][0]);
        acc[a][1] = _mm512_fmadd_ps(p, v1, acc[a][1]);
        acc[a][2] = _mm512_fmadd_ps(p, v2, acc[a][2]);
        acc[a][3] = _mm512_fmadd_ps(p, v3, acc[a][3]);
      }
    }
    for (int64_t a = 0; a < G; ++a)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + (h0 + a) * 64 + c * 16, acc[a][c]);
  }
  (void)Hq;
}

// Up to 16 query rows of one request (a chunk, or speculative rows), head_dim 64, query heads [h_lo, h_hi) in
// groups of G sharing a KV head: flash-style (online softmax) with the rows in the 16 lanes, so scores, the
// running max / sum and the output need no horizontal sums. The keys are taken in pieces of kKeysPerPiece:
// a piece's keys and values of one KV group are copied as float32 into scratch (kc, vc: rows of 64, padded to
// 8 keys; they stay in L2 while every query head of the group walks them). Per query head, q is transposed
// into qt (64 x 16 per head), and each block of 8 keys costs 64 loads and 512 FMAs with broadcast key values
// for the scores, then 64 x 8 FMAs with broadcast values for the output (ot, 64 x 16 per head). Row i
// (position first + i) sees keys 0..first + i. Rows past nrow repeat the last row and are not stored.
// Float32 throughout, like the one-row path (the two agree to rounding, not bit for bit).
template <typename KvT>
void rows_d64(const float* q, int64_t q_row, float* o, int64_t o_row, const KvT* K, const KvT* V,
              const int64_t* row_off, int64_t nrow, int64_t first, int64_t h_lo, int64_t h_hi, int64_t G, float sc,
              float* kc, float* vc, float* qt, float* ot, float* stats) {
  const int64_t nkeys = first + nrow;
  const __m512i pos = _mm512_add_epi32(
      _mm512_set1_epi32(static_cast<int32_t>(first)),
      _mm512_min_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                       _mm512_set1_epi32(static_cast<int32_t>(nrow - 1))));
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  const __m512 scale16 = _mm512_set1_ps(sc);
  for (int64_t g = h_lo / G; g < h_hi / G; ++g) {
    for (int64_t a = 0; a < G; ++a) {  // q transposed, output and running max / sum cleared
      float* qa = qt + a * 1024;
      for (int64_t i = 0; i < 16; ++i) {
        const float* qr = q + std::min(i, nrow - 1) * q_row + (g * G + a) * 64;
        for (int64_t d = 0; d < 64; ++d) qa[d * 16 + i] = qr[d];
      }
      std::memset(ot + a * 1024, 0, sizeof(float) * 1024);
      _mm512_storeu_ps(stats + a * 32, neg_inf);
      _mm512_storeu_ps(stats + a * 32 + 16, _mm512_setzero_ps());
    }
    for (int64_t c0 = 0; c0 < nkeys; c0 += kKeysPerPiece) {
      const int64_t cn = std::min(kKeysPerPiece, nkeys - c0), padded = (cn + 7) / 8 * 8;
      for (int64_t j = 0; j < cn; ++j) {
        const KvT* kr = K + row_off[c0 + j] + g * 64;
        const KvT* vr = V + row_off[c0 + j] + g * 64;
        for (int c = 0; c < 4; ++c) {
          _mm512_storeu_ps(kc + j * 64 + c * 16, load16(kr + c * 16));
          _mm512_storeu_ps(vc + j * 64 + c * 16, load16(vr + c * 16));
        }
      }
      std::memset(kc + cn * 64, 0, sizeof(float) * (padded - cn) * 64);
      std::memset(vc + cn * 64, 0, sizeof(float) * (padded - cn) * 64);
      for (int64_t a = 0; a < G; ++a) {
        const float* qa = qt + a * 1024;
        float* oa = ot + a * 1024;
        __m512 m = _mm512_loadu_ps(stats + a * 32), l = _mm512_loadu_ps(stats + a * 32 + 16);
        for (int64_t jb = 0; jb < padded; jb += 8) {
          __m512 s[8];
          for (int u = 0; u < 8; ++u) s[u] = _mm512_setzero_ps();
          for (int64_t d = 0; d < 64; ++d) {
            const __m512 qd = _mm512_loadu_ps(qa + d * 16);
            const float* kd = kc + jb * 64 + d;
            for (int u = 0; u < 8; ++u) s[u] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kd[u * 64]), s[u]);
          }
          __mmask16 valid[8];
          __m512 top = m;
          for (int u = 0; u < 8; ++u) {  // key c0 + jb + u: valid in the lanes whose position is at or past it
            valid[u] = _mm512_cmp_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(c0 + jb + u)),
                                             _MM_CMPINT_NLT);
            s[u] = _mm512_mask_blend_ps(valid[u], neg_inf, _mm512_mul_ps(s[u], scale16));
            top = _mm512_max_ps(top, s[u]);
          }
          // lanes with no key yet (m = -inf) start from zero; key 0 is valid in every lane, so top is finite
          const __m512 corr = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m, neg_inf, _CMP_NEQ_OQ),
                                                  tallyserve_cpu_math::exp16(_mm512_sub_ps(m, top)));
          m = top;
          __m512 p[8];
          l = _mm512_mul_ps(l, corr);
          for (int u = 0; u < 8; ++u) {
            p[u] = _mm512_maskz_mov_ps(valid[u], tallyserve_cpu_math::exp16(_mm512_sub_ps(s[u], top)));
            l = _mm512_add_ps(l, p[u]);
          }
          for (int64_t d = 0; d < 64; ++d) {
            const float* vd = vc + jb * 64 + d;
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(oa + d * 16), corr);
            for (int u = 0; u < 8; ++u) acc = _mm512_fmadd_ps(p[u], _mm512_set1_ps(vd[u * 64]), acc);
            _mm512_storeu_ps(oa + d * 16, acc);
          }
        }
        _mm512_storeu_ps(stats + a * 32, m);
        _mm512_storeu_ps(stats + a * 32 + 16, l);
      }
    }
    for (int64_t a = 0; a < G; ++a) {  // divide by the sums, rows back out of the lanes
      const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_loadu_ps(stats + a * 32 + 16));
      float* oa = ot + a * 1024;
      for (int64_t d = 0; d < 64; ++d) _mm512_storeu_ps(oa + d * 16, _mm512_mul_ps(_mm512_loadu_ps(oa + d * 16), inv));
      for (int64_t i = 0; i < nrow; ++i) {
        float* orow = o + i * o_row + (g * G + a) * 64;
        for (int64_t d = 0; d < 64; ++d) orow[d] = oa[d * 16 + i];
      }
    }
  }
}
#else
constexpr bool kBuilt = false;
template <typename KvT>
void one_row_d64(const float*, float*, const KvT*, const KvT*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                 int64_t, float, float*) {}
template <typename KvT>
void rows_d64(const float*, int64_t, float*, int64_t, const KvT*, const KvT*, const int64_t*, int64_t, int64_t, int64_t,
              int64_t, int64_t, float, float*, float*, float*, float*, float*) {}
#endif

}  // namespace tallyserve_avx512
