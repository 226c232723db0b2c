// tallyserve CPU paged attention: attention straight from the paged KV cache, no gathered copies.
//
// q: (T, Hq, D) float32 with contiguous heads (rows may be strided: a view into the fused q/k/v);
// kv_cache: (2, num_blocks, block_size, Hkv, D) float32 or bfloat16, contiguous;
// block_tables: (R, max_blocks) int32; query_start_loc: (R + 1) int64; seq_lens: (R) int64.
// Request r owns query rows [query_start_loc[r], query_start_loc[r + 1]), at positions
// [seq_len - rows, seq_len); row at position p attends keys 0..p (causal). Returns (T, Hq, D).
//
// One work item is (request, a run of up to 16 query rows: 8 on the AVX2 paths), all heads (with fewer items than
// threads, an item is split by KV head group). Items, largest first, are taken by ATen's threads from a shared
// counter, so a thread the OS deschedules holds up only its current item, not a fixed share. At head_dim 64 with
// vector paths (16 lanes of AVX-512, or 8 of AVX2 + FMA: attention_avx2_cpu.h), a one-row item (decode) keeps its
// scores whole (softmax: max, exp, sum in float32, like the reference) and reads each K/V row once for all query
// heads of its group (one_row_d64); a multi-row item (a chunk, speculative rows) runs flash-style with its rows in
// the vector lanes (rows_d64); over a bfloat16 cache on a CPU with AMX, items of up to 64 rows take
// attention_amx_cpu.cpp's tiles instead. Otherwise a generic loop: each position's K row (every KV head,
// contiguous) read once for all query heads of the item, scores kept whole per row, then the weighted V rows
// summed. The widest path built is the default; set_vector_width picks a narrower one (tests run each).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_amx_cpu.h"
#include "attention_avx2_cpu.h"
#include "attention_vec_cpu.h"
#include "cpu_math.h"
#include "task_pool_cpu.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRowsPerItem = 16;
constexpr int64_t kKeysPerPiece = 256;  // rows_d64: keys per piece of float32 scratch

using namespace tallyserve_attention_vec;
using tallyserve_cpu_ops::run_tasks;
using tallyserve_cpu_ops::task_threads;

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kHaveAvx2Kernel = true;
#else
constexpr bool kHaveAvx2Kernel = false;
#endif

#if defined(__AVX512F__)
constexpr bool kHaveRowKernel = true;

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
constexpr bool kHaveRowKernel = false;
template <typename KvT>
void one_row_d64(const float*, float*, const KvT*, const KvT*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                 int64_t, float, float*) {}
template <typename KvT>
void rows_d64(const float*, int64_t, float*, int64_t, const KvT*, const KvT*, const int64_t*, int64_t, int64_t, int64_t,
              int64_t, int64_t, float, float*, float*, float*, float*, float*) {}
#endif

// Lanes of the head_dim-64 vector paths in use: 16 (AVX-512), 8 (AVX2 + FMA) or 0 (the generic loop only).
constexpr int64_t kWidestPath = kHaveRowKernel ? 16 : (kHaveAvx2Kernel ? 8 : 0);
std::atomic<int64_t> g_width{kWidestPath};

#if defined(__AVX2__) && defined(__FMA__)
static_assert(tallyserve_avx2::kKeysPerPiece <= kKeysPerPiece, "attend_items sizes the AVX2 path's scratch");
constexpr int64_t kAvx2RowPiece = tallyserve_avx2::kRowPiece;

template <typename KvT>
void avx2_one_row(const float* q, float* o, const KvT* K, const KvT* V, const int64_t* row_off, int64_t nkeys,
                  int64_t h_lo, int64_t h_hi, int64_t G, float sc, float* scores, KvT* buf) {
  tallyserve_avx2::one_row_d64(q, o, K, V, row_off, nkeys, h_lo, h_hi, G, sc, scores, buf);
}
template <typename KvT>
void avx2_rows(const float* q, int64_t q_row, float* o, int64_t o_row, const KvT* K, const KvT* V,
               const int64_t* row_off, int64_t nrow, int64_t first, int64_t h_lo, int64_t h_hi, int64_t G, float sc,
               float* kc, float* vc, float* qt, float* ot, float* stats) {
  tallyserve_avx2::rows_d64(q, q_row, o, o_row, K, V, row_off, nrow, first, h_lo, h_hi, G, sc, kc, vc, qt, ot, stats);
}
#else
constexpr int64_t kAvx2RowPiece = 0;
template <typename KvT>
void avx2_one_row(const float*, float*, const KvT*, const KvT*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                  float, float*, KvT*) {}
template <typename KvT>
void avx2_rows(const float*, int64_t, float*, int64_t, const KvT*, const KvT*, const int64_t*, int64_t, int64_t,
               int64_t, int64_t, int64_t, float, float*, float*, float*, float*, float*) {}
#endif

struct Item {
  int64_t req, row_lo, row_hi, cost, head_lo, head_hi;  // query heads [head_lo, head_hi)
};

// The items of one call over a cache of KvT (float32, or bfloat16 bits).
template <typename KvT>
void attend_items(const at::Tensor& q, at::Tensor& out, const KvT* K, const std::vector<Item>& items,
                  const int64_t* qsl, const int64_t* sl, const int32_t* bt, int64_t MB, int64_t NB, int64_t BS,
                  int64_t Hq, int64_t Hkv, int64_t D, int64_t G, double scale, bool amx, int64_t width) {
  const float* Q = q.data_ptr<float>();
  const int64_t q_row = q.stride(0);  // q may be a view of the fused q/k/v rows
  const KvT* V = K + NB * BS * Hkv * D;
  float* O = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t row_stride = Hkv * D;  // values from one position to the next: all KV heads side by side
  const int64_t n_items = static_cast<int64_t>(items.size());
  // Items are taken from a shared counter as threads finish, largest first (run_tasks); each thread's scratch is
  // its own and kept from call to call.
  run_tasks(n_items, [&](int64_t it) {
    thread_local std::vector<float> scores;
    thread_local tallyserve_amx::Scratch amx_scratch;
    // rows_d64's scratch, sized on first use (a decode-only call never needs it): a piece of float32 keys and
    // values, per query head of a group q transposed, the output, the running max and sum
    thread_local std::vector<float> kc, vc, qt, ot, stats;
    thread_local std::vector<int64_t> row_off;  // each key's row offset in the cache (no division per key in the loops)
    const Item& w = items[it];
    const int64_t len = sl[w.req], rows = qsl[w.req + 1] - qsl[w.req];
    const int32_t* blocks = bt + w.req * MB;
    const int64_t nkeys = len - rows + w.row_hi;  // keys the last row of this item sees
    const int64_t nrow = w.row_hi - w.row_lo;
    const float* q0 = Q + (qsl[w.req] + w.row_lo) * q_row;
    float* o0 = O + (qsl[w.req] + w.row_lo) * Hq * D;
    row_off.resize(static_cast<size_t>(nkeys));
    for (int64_t b = 0, j = 0; j < nkeys; ++b) {
      const int64_t base = static_cast<int64_t>(blocks[b]) * BS * row_stride;
      for (int64_t r = 0; r < BS && j < nkeys; ++r, ++j) row_off[j] = base + r * row_stride;
    }
    if (width && D == 64 && G <= 4 && nrow == 1) {
      if (scores.size() < static_cast<size_t>(Hq * nkeys)) scores.resize(static_cast<size_t>(Hq * nkeys));
      if (width == 16)
        one_row_d64(q0, o0, K, V, row_off.data(), nkeys, Hq, w.head_lo, w.head_hi, G, sc, scores.data());
      else {
        thread_local std::vector<KvT> rows_buf;  // one_row_d64's piece of K or V rows
        rows_buf.resize(static_cast<size_t>(kAvx2RowPiece * Hkv * D));
        avx2_one_row(q0, o0, K, V, row_off.data(), nkeys, w.head_lo, w.head_hi, G, sc, scores.data(), rows_buf.data());
      }
      return;
    }
    if constexpr (std::is_same<KvT, uint16_t>::value) {
      if (width == 16 && D == 64 && amx) {
        tallyserve_amx::rows_bf16(q0, q_row, o0, Hq * D, K, V, row_off.data(), nrow, len - rows + w.row_lo,
                                  w.head_lo, w.head_hi, G, sc, amx_scratch);
        return;
      }
    }
    if (width == 8 && D == 64) {
      if (kc.empty()) kc.resize(kKeysPerPiece * 64), vc.resize(kKeysPerPiece * 64);
      if (qt.size() < static_cast<size_t>(G * 512)) qt.resize(G * 512), ot.resize(G * 512), stats.resize(G * 16);
      avx2_rows(q0, q_row, o0, Hq * D, K, V, row_off.data(), nrow, len - rows + w.row_lo, w.head_lo, w.head_hi, G,
                sc, kc.data(), vc.data(), qt.data(), ot.data(), stats.data());
      return;
    }
    if (width == 16 && D == 64) {
      if (kc.empty()) kc.resize(kKeysPerPiece * 64), vc.resize(kKeysPerPiece * 64);
      if (qt.size() < static_cast<size_t>(G * 1024)) qt.resize(G * 1024), ot.resize(G * 1024), stats.resize(G * 32);
      rows_d64(q0, q_row, o0, Hq * D, K, V, row_off.data(), nrow, len - rows + w.row_lo, w.head_lo, w.head_hi, G,
               sc, kc.data(), vc.data(), qt.data(), ot.data(), stats.data());
      return;
    }
    scores.assign(static_cast<size_t>(nrow * Hq * nkeys), 0.f);
    // scores[(i * Hq + h) * nkeys + j] = q_i,h . k_j * scale: one pass over the keys, every head of
    // every row of the item reading the key's row (all KV heads, contiguous) while it is in cache
    for (int64_t j = 0; j < nkeys; ++j) {
      const KvT* kr = K + row_off[j];
      for (int64_t i = 0; i < nrow; ++i) {
        if (j > len - rows + w.row_lo + i) continue;
        for (int64_t h = w.head_lo; h < w.head_hi; ++h)
          scores[(i * Hq + h) * nkeys + j] = dot(q0 + i * q_row + h * D, kr + (h / G) * D, D) * sc;
      }
    }
    for (int64_t i = 0; i < nrow; ++i) {
      const int64_t n = len - rows + w.row_lo + i + 1;
      for (int64_t h = w.head_lo; h < w.head_hi; ++h) softmax_inplace(scores.data() + (i * Hq + h) * nkeys, n);
    }
    for (int64_t i = 0; i < nrow; ++i)  // the output is not zero-filled: this item's part, before summing
      std::memset(o0 + (i * Hq + w.head_lo) * D, 0, sizeof(float) * (w.head_hi - w.head_lo) * D);
    for (int64_t j = 0; j < nkeys; ++j) {
      const KvT* vr = V + row_off[j];
      for (int64_t i = 0; i < nrow; ++i) {
        if (j > len - rows + w.row_lo + i) continue;
        for (int64_t h = w.head_lo; h < w.head_hi; ++h)
          axpy(o0 + (i * Hq + h) * D, vr + (h / G) * D, scores[(i * Hq + h) * nkeys + j], D);
      }
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale) {
  // (a dimension of size 1 may carry any stride, as in PyTorch's own contiguity test)
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 &&
                  (q.size(1) <= 1 || q.stride(1) == q.size(2)) && (q.size(0) <= 1 || q.stride(0) >= q.size(1) * q.size(2)),
              "q: float32 (T, Hq, D) with contiguous heads (rows may be strided)");
  TORCH_CHECK(kv_cache.dim() == 5 && (kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16) &&
                  kv_cache.is_contiguous(),
              "kv_cache: contiguous float32 or bfloat16 (2, blocks, block_size, Hkv, D)");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables: contiguous int32 (R, max_blocks)");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "query_start_loc and seq_lens: int64");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && Hq % Hkv == 0, "head shapes of q and kv_cache disagree");
  const int64_t R = seq_lens.size(0), MB = block_tables.size(1);
  TORCH_CHECK(query_start_loc.size(0) == R + 1 && block_tables.size(0) >= R, "one block-table row and length per request");
  const int64_t G = Hq / Hkv;

  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  TORCH_CHECK(qsl[0] >= 0 && qsl[0] <= T && qsl[R] <= T, "query_start_loc outside q's rows");
  // (the AMX path takes longer runs of rows: its tiles of 16 rows share the copies of K and V^T)
  const int64_t width = g_width.load();  // taken once: the items are cut for the path that runs them
  const bool amx = kv_cache.scalar_type() == at::kBFloat16 && D == 64 && width == 16 && tallyserve_amx::usable();
  const int64_t per_item = amx ? tallyserve_amx::kRowsPerItem : (width == 8 ? tallyserve_avx2::kRows : kRowsPerItem);
  std::vector<Item> items;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t rows = qsl[r + 1] - qsl[r];
    TORCH_CHECK(rows >= 0 && rows <= sl[r] && qsl[r + 1] <= T, "request ", r, ": bad query rows or length");
    TORCH_CHECK((sl[r] + BS - 1) / BS <= MB, "request ", r, ": seq_len past its block table");
    for (int64_t b = 0; b < (sl[r] + BS - 1) / BS; ++b)
      TORCH_CHECK(bt[r * MB + b] >= 0 && bt[r * MB + b] < NB, "request ", r, ": block id out of range");
    for (int64_t lo = 0; lo < rows; lo += per_item) {
      const int64_t hi = std::min(rows, lo + per_item);
      items.push_back({r, lo, hi, (hi - lo) * (sl[r] - rows + hi), 0, Hq});
    }
  }
  // Fewer items than threads (one or two sequences decoding): split each item by KV head group, so every
  // thread has work; each part still reads a key row's heads of its group while the row is in cache.
  if (Hkv > 1 && static_cast<int64_t>(items.size()) < task_threads()) {
    std::vector<Item> parts;
    for (const Item& w : items)
      for (int64_t g = 0; g < Hkv; ++g) parts.push_back({w.req, w.row_lo, w.row_hi, w.cost / Hkv, g * G, (g + 1) * G});
    items.swap(parts);
  }
  // Largest first, taken from a shared counter: a static split of unequal requests left one thread idle while the
  // other finished the long ones.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

  // Every row of every request is written by its items (the one-row path stores, the general path zeroes its
  // part first); only rows outside all requests are zeroed here.
  at::Tensor out = at::empty({T, Hq, D}, q.options());
  if (qsl[0] > 0) out.narrow(0, 0, qsl[0]).zero_();
  if (qsl[R] < T) out.narrow(0, qsl[R], T - qsl[R]).zero_();
  if (kv_cache.scalar_type() == at::kFloat)
    attend_items(q, out, kv_cache.data_ptr<float>(), items, qsl, sl, bt, MB, NB, BS, Hq, Hkv, D, G, scale, false,
                 width);
  else
    attend_items(q, out, reinterpret_cast<const uint16_t*>(kv_cache.data_ptr<at::BFloat16>()), items, qsl, sl, bt, MB,
                 NB, BS, Hq, Hkv, D, G, scale, amx, width);
  return out;
}

}  // namespace

// Whether a vector path for head_dim 64 is in use (one_row_d64, rows_d64: AVX-512 or AVX2); without one, multi-row
// items take a slow generic loop, and the Python side sends long chunks to PyTorch's SDPA instead.
bool has_fast_rows() { return g_width.load() > 0; }

// The lanes of the head_dim-64 path in use (16, 8, or 0 for the generic loop only).
int64_t vector_width() { return g_width.load(); }

// Use the path of `width` lanes (16, 8 or 0) where this build has it; returns the width in use after the call.
int64_t set_vector_width(int64_t width) {
  TORCH_CHECK(width == 0 || width == 8 || width == 16, "vector width must be 0, 8 or 16");
  const bool built = width == 0 || (width == 8 && kHaveAvx2Kernel) || (width == 16 && kHaveRowKernel);
  if (built) g_width.store(width);
  return g_width.load();
}

TORCH_LIBRARY(tallyserve_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, "
        "float scale) -> Tensor");
  m.def("has_fast_rows() -> bool", &has_fast_rows);
  m.def("vector_width() -> int", &vector_width);
  m.def("set_vector_width(int width) -> int", &set_vector_width);
}

TORCH_LIBRARY_IMPL(tallyserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
