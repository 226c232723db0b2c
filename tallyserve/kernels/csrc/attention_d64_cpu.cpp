// tallyserve CPU attention at head_dim 64 on 8-lane AVX2 + FMA and 16-lane AVX-512 vectors: the paths of
// paged_attention_cpu.cpp's items when the vector width in use is 8 or 16 (arguments: attention_d64_cpu.h).
//   rows_d64<W>      up to W query rows of one request (a chunk, speculative rows), flash-style: the rows in the W
//                    lanes, so scores, the running max / sum and the output need no horizontal sums. Written once over
//                    simd_cpu.h's Vec<W>: both widths run the same operations in the same order per lane.
//   one_row_d64<16>  one query row (decode): the keys read in place from the cache (prefetched two blocks of eight
//                    ahead), each value row loaded once into four 16-lane registers for every query head of its group.
//   one_row_d64<8>   one query row (decode): the keys in pieces of kRowPiece copied out of the cache first, values in
//                    two halves of 32 dimensions so each head's sums stay in the sixteen 8-lane registers.
//   rows_gemm        (8 lanes) a prompt chunk's rows as small matrix products over its keys packed once.
// The two decode rows are different kernels, not one written twice: the 8-lane row copies its keys out of the cache
// first (measured faster on Zen 3, below) and halves the value dimensions to fit its registers, and each score's
// products are summed in another order (eight FMAs of 8 lanes; four of 16 folded to 8), so they differ in the last
// bits. Their shared pieces (the eight-vector lane sums, the cache loads, exp) are written once. Likewise the 8-lane
// softmax (a scalar tail) and attention_vec_cpu.h's (masked 16-lane tails) sum in different orders and stay two.

#include "attention_d64_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention_vec_cpu.h"
#include "cpu_math.h"
#include "simd_cpu.h"

namespace tallyserve_attention_d64 {

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
using tallyserve_cpu_math::exp_vec;
using tallyserve_simd::Vec;

namespace {

// The sums of eight vectors' lanes, as one vector: [sum(v[0]), ..., sum(v[7])].
inline __m256 hsum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

#if defined(__AVX2__) && defined(__FMA__)
using V8 = Vec<8>;

// Softmax of n scores in place, in float32: max, exp, sum, scale (the tail past a multiple of 8 in scalar code).
inline void softmax8_inplace(float* s, int64_t n) {
  const int64_t n8 = n / 8 * 8;
  float mx = s[0];
  if (n8) {
    __m256 m8 = _mm256_loadu_ps(s);
    for (int64_t j = 8; j < n8; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + j));
    mx = V8::hmax(m8);
  }
  for (int64_t j = n8; j < n; ++j) mx = std::max(mx, s[j]);
  const __m256 mxv = _mm256_set1_ps(mx);
  __m256 sum8 = _mm256_setzero_ps();
  for (int64_t j = 0; j < n8; j += 8) {
    const __m256 e = exp_vec<8>(_mm256_sub_ps(_mm256_loadu_ps(s + j), mxv));
    sum8 = _mm256_add_ps(sum8, e);
    _mm256_storeu_ps(s + j, e);
  }
  float sum = V8::hsum(sum8);
  for (int64_t j = n8; j < n; ++j) {
    s[j] = tallyserve_cpu_math::exp_float(s[j] - mx);
    sum += s[j];
  }
  const float inv = 1.f / sum;
  const __m256 inv8 = _mm256_set1_ps(inv);
  for (int64_t j = 0; j < n8; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv8));
  for (int64_t j = n8; j < n; ++j) s[j] *= inv;
}

// ---- one query row on 8 lanes ----

// The eight lane-partial products of query head qh (64 floats) with key row kr.
template <typename KvT>
inline __m256 dot64_8(const float* qh, const KvT* kr) {
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qh), V8::load(kr));
  for (int c = 1; c < 8; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c), V8::load(kr + 8 * c), acc);
  return acc;
}

// Rows [j0, j1) of KV heads [g_lo, g_lo + ng) from the paged cache into dst, side by side (rows of ng * 64).
template <typename KvT>
inline void copy_rows(KvT* dst, const KvT* src, const int64_t* row_off, int64_t j0, int64_t j1, int64_t g_lo,
                      int64_t ng) {
  const int64_t w = ng * 64;
  for (int64_t j = j0; j < j1; ++j) std::memcpy(dst + (j - j0) * w, src + row_off[j] + g_lo * 64, w * sizeof(KvT));
}

// KV head groups [g_lo, g_hi) of G (1 to 4) query heads each. The keys go in pieces of kRowPiece: each piece's K
// rows (then, after the softmax, its V rows) are first copied from the cache into buf, a tight copy loop that keeps
// many cache misses in flight, and the arithmetic then reads them from L1 / L2. Reading the cache inside the
// arithmetic kept few misses in flight: on a 2-core Zen 3, W's decode steps of 64 sequences spent 58-64 ms per step
// in attention that way and 50-54 with the copies. Each score is one key's dot product, eight keys' lane sums
// reduced together (the keys past a multiple of 8 one at a time); each output sums its keys in order, so the pieces
// change no bit of the result.
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
          for (int u = 0; u < 8; ++u) part[u] = dot64_8(qh, kr + u * w + g * 64);
          _mm256_storeu_ps(scores + h * nkeys + j0, _mm256_mul_ps(hsum8(part), scale8));
        }
    }
    for (int64_t j = std::max(p0, n8); j < p1; ++j)
      for (int64_t g = 0; g < ng; ++g)
        for (int a = 0; a < G; ++a) {
          const int64_t h = (g_lo + g) * G + a;
          scores[h * nkeys + j] = V8::hsum(dot64_8(q + h * 64, buf + (j - p0) * w + g * 64)) * sc;
        }
  }
  for (int64_t h = g_lo * G; h < g_hi * G; ++h) softmax8_inplace(scores + h * nkeys, nkeys);
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
          const __m256 v0 = V8::load(vr), v1 = V8::load(vr + 8), v2 = V8::load(vr + 16), v3 = V8::load(vr + 24);
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

// ---- query rows of a prompt chunk as small matrix products (rows_gemm, 8 lanes) ----
// Per KV head: its keys packed once as 16-key panels of K transposed (kt) and its values as rows (vr), both float32,
// for every query head and row of the item. Then per query head, six rows at a time: the scores of each 16-key panel
// as one 6 x 16 register tile over the 64 dimensions (the product kernel's tile: one broadcast of six q values and
// two panel loads per dimension), the softmax of each row over its keys whole (as the decode row: max, exp, sum,
// scale), and the output in 6 x 16 tiles over the keys. The flash path (rows_d64<8>) reads its keys with one
// broadcast per multiply: on a 2-core Zen 3, 16 prompts of 512 tokens (9 heads, 3 KV heads) took 58-62 ms there and
// 37 ms here, and W's prompt attention 2.16 -> 1.36 s.

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
          for (int u = 0; u < 8; ++u) r[u] = V8::load(K + row_off[p * 16 + half * 8 + u] + g * 64 + d0);
          transpose8(r);
          for (int d = 0; d < 8; ++d) _mm256_storeu_ps(dst + (d0 + d) * 16 + half * 8, r[d]);
        }
      continue;
    }
    for (int64_t u = 0; u < cnt; ++u) {
      const KvT* kr = K + row_off[p * 16 + u] + g * 64;
      for (int64_t d = 0; d < 64; ++d) dst[d * 16 + u] = tallyserve_attention_vec::kv_value(kr, d);
    }
    for (int64_t u = cnt; u < 16; ++u)
      for (int64_t d = 0; d < 64; ++d) dst[d * 16 + u] = 0.f;
  }
  for (int64_t j = 0; j < n; ++j) {
    const KvT* src = V + row_off[j] + g * 64;
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(vr + j * 64 + c * 8, V8::load(src + c * 8));
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
    softmax8_inplace(sr, last0 + r + 1);
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
#endif  // AVX2 + FMA

#if defined(__AVX512F__)
using V16 = Vec<16>;

// One head's 64 cached values into L1 (four 64-byte lines of float32, two of bfloat16).
template <typename KvT>
inline void prefetch_row(const KvT* p) {
  const char* c = reinterpret_cast<const char*>(p);
  for (size_t off = 0; off < 64 * sizeof(KvT); off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// The products of one head_dim-64 query (four registers) and key row, in 16 lanes.
template <typename KvT>
inline __m512 dot64_16(const __m512* qv, const KvT* kr) {
  __m512 acc = _mm512_mul_ps(qv[0], V16::load(kr));
  acc = _mm512_fmadd_ps(qv[1], V16::load(kr + 16), acc);
  acc = _mm512_fmadd_ps(qv[2], V16::load(kr + 32), acc);
  return _mm512_fmadd_ps(qv[3], V16::load(kr + 48), acc);
}

// The same, folded to 8 lanes.
template <typename KvT>
inline __m256 dot64_16_half(const __m512* qv, const KvT* kr) {
  const __m512 acc = dot64_16(qv, kr);
  return _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
}

// Scores: eight keys at a time per query head, their lane sums reduced together (one reduction of eight vectors
// instead of eight full horizontal sums: the shuffles were the bottleneck). Values: each value row of a group is
// loaded into registers once for all its query heads, the sums stay in registers across the keys.
template <typename KvT>
void one_row_16(const float* q, float* o, const KvT* K, const KvT* V, const int64_t* row_off, int64_t nkeys,
                int64_t h_lo, int64_t h_hi, int64_t G, float sc, float* scores) {
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
        for (int u = 0; u < 8; ++u) part[u] = dot64_16_half(qv, kr[u]);
        _mm256_storeu_ps(scores + (h0 + a) * nkeys + j0, _mm256_mul_ps(hsum8(part), scale8));
      }
    }
    for (int64_t a = 0; a < G; ++a) {
      const float* qh = q + (h0 + a) * 64;
      const __m512 qv[4] = {_mm512_loadu_ps(qh), _mm512_loadu_ps(qh + 16), _mm512_loadu_ps(qh + 32),
                            _mm512_loadu_ps(qh + 48)};
      for (int64_t j = j0; j < nkeys; ++j) {
        const KvT* kr = Kg + row_off[j];
        scores[(h0 + a) * nkeys + j] = V16::hsum(dot64_16(qv, kr)) * sc;
      }
    }
    for (int64_t a = 0; a < G; ++a) tallyserve_attention_vec::softmax_inplace(scores + (h0 + a) * nkeys, nkeys);
    __m512 acc[4][4];
    for (int64_t a = 0; a < G; ++a)
      for (int c = 0; c < 4; ++c) acc[a][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nkeys; ++j) {
      const KvT* vr = V + row_off[j] + g * 64;
      if (j + 8 < nkeys) prefetch_row(V + row_off[j + 8] + g * 64);
      const __m512 v0 = V16::load(vr), v1 = V16::load(vr + 16), v2 = V16::load(vr + 32), v3 = V16::load(vr + 48);
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
}
#endif  // AVX-512

}  // namespace

template <int W, typename KvT>
void one_row_d64(const float* q, float* o, const KvT* K, const KvT* V, const int64_t* row_off, int64_t nkeys,
                 int64_t h_lo, int64_t h_hi, int64_t G, float sc, float* scores, KvT* buf) {
  static_assert(W == 8 || W == 16, "8 or 16 lanes");
#if defined(__AVX512F__)
  if constexpr (W == 16) one_row_16(q, o, K, V, row_off, nkeys, h_lo, h_hi, G, sc, scores);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (W == 8) {
    const int64_t g_lo = h_lo / G, g_hi = h_hi / G;
    switch (G) {
      case 1: one_row_groups<1>(q, o, K, V, row_off, nkeys, g_lo, g_hi, sc, scores, buf); break;
      case 2: one_row_groups<2>(q, o, K, V, row_off, nkeys, g_lo, g_hi, sc, scores, buf); break;
      case 3: one_row_groups<3>(q, o, K, V, row_off, nkeys, g_lo, g_hi, sc, scores, buf); break;
      default: one_row_groups<4>(q, o, K, V, row_off, nkeys, g_lo, g_hi, sc, scores, buf); break;
    }
  }
#endif
  (void)buf;
}

// Per KV group, the keys in pieces of kKeysPerPiece: a piece's keys and values are copied as float32 into kc, vc
// (rows of 64, padded to 8 keys; they stay in L2 while every query head of the group walks them). Per query head,
// q is transposed into qt (64 x W), and each block of 8 keys costs 64 loads and 512 FMAs with broadcast key values
// for the scores, then 64 x 8 FMAs with broadcast values for the output (ot, 64 x W); the running max and sum in
// stats (2 x W). Lanes past nrow repeat the last row and are not stored. Float32 throughout, like the one-row paths
// (the two agree to rounding, not bit for bit).
template <int W, typename KvT>
void rows_d64(const float* q, int64_t q_row, float* o, int64_t o_row, const KvT* K, const KvT* V,
              const int64_t* row_off, int64_t nrow, int64_t first, int64_t h_lo, int64_t h_hi, int64_t G, float sc,
              float* kc, float* vc, float* qt, float* ot, float* stats) {
  using Vw = Vec<W>;
  using reg = typename Vw::reg;
  const int64_t nkeys = first + nrow;
  // lane i: the position of row min(i, nrow - 1)
  const typename Vw::ireg pos = Vw::add_i(Vw::set1_i(static_cast<int32_t>(first)),
                                          Vw::min_i(Vw::lanes_i(), Vw::set1_i(static_cast<int32_t>(nrow - 1))));
  const reg neg_inf = Vw::set1(-INFINITY);
  const reg scale = Vw::set1(sc);
  for (int64_t g = h_lo / G; g < h_hi / G; ++g) {
    for (int64_t a = 0; a < G; ++a) {  // q transposed, output and running max / sum cleared
      float* qa = qt + a * 64 * W;
      for (int64_t i = 0; i < W; ++i) {
        const float* qr = q + std::min(i, nrow - 1) * q_row + (g * G + a) * 64;
        for (int64_t d = 0; d < 64; ++d) qa[d * W + i] = qr[d];
      }
      std::memset(ot + a * 64 * W, 0, sizeof(float) * 64 * W);
      Vw::store(stats + a * 2 * W, neg_inf);
      Vw::store(stats + a * 2 * W + W, Vw::zero());
    }
    for (int64_t c0 = 0; c0 < nkeys; c0 += kKeysPerPiece) {
      const int64_t cn = std::min(kKeysPerPiece, nkeys - c0), padded = (cn + 7) / 8 * 8;
      for (int64_t j = 0; j < cn; ++j) {
        const KvT* kr = K + row_off[c0 + j] + g * 64;
        const KvT* vr = V + row_off[c0 + j] + g * 64;
        for (int c = 0; c < 64; c += W) {
          Vw::store(kc + j * 64 + c, Vw::load(kr + c));
          Vw::store(vc + j * 64 + c, Vw::load(vr + c));
        }
      }
      std::memset(kc + cn * 64, 0, sizeof(float) * (padded - cn) * 64);
      std::memset(vc + cn * 64, 0, sizeof(float) * (padded - cn) * 64);
      for (int64_t a = 0; a < G; ++a) {
        const float* qa = qt + a * 64 * W;
        float* oa = ot + a * 64 * W;
        reg m = Vw::load(stats + a * 2 * W), l = Vw::load(stats + a * 2 * W + W);
        for (int64_t jb = 0; jb < padded; jb += 8) {
          reg s[8];
          for (int u = 0; u < 8; ++u) s[u] = Vw::zero();
          for (int64_t d = 0; d < 64; ++d) {
            const reg qd = Vw::load(qa + d * W);
            const float* kd = kc + jb * 64 + d;
            for (int u = 0; u < 8; ++u) s[u] = Vw::fmadd(qd, Vw::broadcast(kd + u * 64), s[u]);
          }
          typename Vw::mask seen[8];
          reg top = m;
          for (int u = 0; u < 8; ++u) {  // key c0 + jb + u: seen by the lanes whose position is at or past it
            seen[u] = Vw::gt_i(pos, Vw::set1_i(static_cast<int32_t>(c0 + jb + u - 1)));
            s[u] = Vw::select(seen[u], Vw::mul(s[u], scale), neg_inf);
            top = Vw::max(top, s[u]);
          }
          // lanes with no key yet (m = -inf) start from zero; key 0 is valid in every lane, so top is finite
          const reg corr = Vw::zero_unless(Vw::neq(m, neg_inf), exp_vec<W>(Vw::sub(m, top)));
          m = top;
          reg p[8];
          l = Vw::mul(l, corr);
          for (int u = 0; u < 8; ++u) {
            p[u] = Vw::zero_unless(seen[u], exp_vec<W>(Vw::sub(s[u], top)));
            l = Vw::add(l, p[u]);
          }
          for (int64_t d = 0; d < 64; ++d) {
            const float* vd = vc + jb * 64 + d;
            reg acc = Vw::mul(Vw::load(oa + d * W), corr);
            for (int u = 0; u < 8; ++u) acc = Vw::fmadd(p[u], Vw::broadcast(vd + u * 64), acc);
            Vw::store(oa + d * W, acc);
          }
        }
        Vw::store(stats + a * 2 * W, m);
        Vw::store(stats + a * 2 * W + W, l);
      }
    }
    for (int64_t a = 0; a < G; ++a) {  // divide by the sums, rows back out of the lanes
      const reg inv = Vw::div(Vw::set1(1.f), Vw::load(stats + a * 2 * W + W));
      float* oa = ot + a * 64 * W;
      for (int64_t d = 0; d < 64; ++d) Vw::store(oa + d * W, Vw::mul(Vw::load(oa + d * W), inv));
      for (int64_t i = 0; i < nrow; ++i) {
        float* orow = o + i * o_row + (g * G + a) * 64;
        for (int64_t d = 0; d < 64; ++d) orow[d] = oa[d * W + i];
      }
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
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
#endif

// The instances paged_attention_cpu.cpp calls: each width the build has, over either cache.
#define TS_D64_INSTANCES(W, KvT)                                                                                   \
  template void one_row_d64<W, KvT>(const float*, float*, const KvT*, const KvT*, const int64_t*, int64_t, int64_t, \
                                    int64_t, int64_t, float, float*, KvT*);                                         \
  template void rows_d64<W, KvT>(const float*, int64_t, float*, int64_t, const KvT*, const KvT*, const int64_t*,   \
                                 int64_t, int64_t, int64_t, int64_t, int64_t, float, float*, float*, float*, float*, \
                                 float*);
#if defined(__AVX2__) && defined(__FMA__)
TS_D64_INSTANCES(8, float)
TS_D64_INSTANCES(8, uint16_t)
template void rows_gemm<float>(const float*, int64_t, float*, int64_t, const float*, const float*, const int64_t*,
                               int64_t, int64_t, int64_t, int64_t, int64_t, float, float*, float*, float*);
template void rows_gemm<uint16_t>(const float*, int64_t, float*, int64_t, const uint16_t*, const uint16_t*,
                                  const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, float, float*, float*,
                                  float*);
#endif
#if defined(__AVX512F__)
TS_D64_INSTANCES(16, float)
TS_D64_INSTANCES(16, uint16_t)
#endif
#undef TS_D64_INSTANCES

#endif  // AVX2 + FMA or AVX-512

}  // namespace tallyserve_attention_d64
