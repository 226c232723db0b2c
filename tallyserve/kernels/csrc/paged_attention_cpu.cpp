// tallyserve CPU paged attention: attention straight from the paged KV cache, no gathered copies.
//
// q: (T, Hq, D) float32 with contiguous heads (rows may be strided: a view into the fused q/k/v);
// kv_cache: (2, num_blocks, block_size, Hkv, D) float32 or bfloat16, contiguous;
// block_tables: (R, max_blocks) int32; query_start_loc: (R + 1) int64; seq_lens: (R) int64.
// Request r owns query rows [query_start_loc[r], query_start_loc[r + 1]), at positions
// [seq_len - rows, seq_len); row at position p attends keys 0..p (causal). Returns (T, Hq, D).
//
// One work item is (request, a run of up to 16 query rows: 192 on the AVX2 path), all heads (with fewer items than
// threads, an item is split by KV head group). Items, largest first, are taken by ATen's threads from a shared
// counter, so a thread the OS deschedules holds up only its current item, not a fixed share. At head_dim 64 with
// vector paths (16 lanes of AVX-512, or 8 of AVX2 + FMA: attention_d64_cpu.cpp), a one-row item (decode) keeps its
// scores whole (softmax: max, exp, sum in float32, like the reference) and reads each K/V row once for all query
// heads of its group (one_row_d64); a multi-row item (a chunk, speculative rows) runs flash-style with its rows in
// the vector lanes (rows_d64), or on AVX2 as small matrix products over its keys packed once (rows_gemm, up to
// 4,096 keys); over a bfloat16 cache on a CPU with AMX, items of up to 64 rows take
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
#include "attention_d64_cpu.h"
#include "attention_vec_cpu.h"
#include "task_pool_cpu.h"

namespace {

constexpr int64_t kRowsPerItem = 16;

namespace d64 = tallyserve_attention_d64;
using namespace tallyserve_attention_vec;
using tallyserve_cpu_ops::run_tasks;
using tallyserve_cpu_ops::task_threads;

// Lanes of the head_dim-64 vector paths in use: 16 (AVX-512), 8 (AVX2 + FMA) or 0 (the generic loop only).
constexpr int64_t kWidestPath = d64::kHave16 ? 16 : (d64::kHave8 ? 8 : 0);
std::atomic<int64_t> g_width{kWidestPath};

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
      if (width == 16) {
        if constexpr (d64::kHave16)
          d64::one_row_d64<16>(q0, o0, K, V, row_off.data(), nkeys, w.head_lo, w.head_hi, G, sc, scores.data(),
                               static_cast<KvT*>(nullptr));
      } else if constexpr (d64::kHave8) {
        thread_local std::vector<KvT> rows_buf;  // one_row_d64<8>'s piece of K or V rows
        rows_buf.resize(static_cast<size_t>(d64::kRowPiece * Hkv * D));
        d64::one_row_d64<8>(q0, o0, K, V, row_off.data(), nkeys, w.head_lo, w.head_hi, G, sc, scores.data(),
                            rows_buf.data());
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
    if (width && D == 64) {
      const int64_t first = len - rows + w.row_lo;
      if constexpr (d64::kHave8) {
        if (width == 8 && nkeys <= d64::kGemmMaxKeys) {  // the item's rows as small products over its keys packed once
          thread_local std::vector<float> kt, vr;
          const size_t packed = static_cast<size_t>((nkeys + 15) / 16 * 16 * 64);
          if (kt.size() < packed) kt.resize(packed), vr.resize(packed);
          if (scores.size() < packed / 64 * 6) scores.resize(packed / 64 * 6);
          d64::rows_gemm(q0, q_row, o0, Hq * D, K, V, row_off.data(), nrow, first, w.head_lo, w.head_hi, G, sc,
                         kt.data(), vr.data(), scores.data());
          return;
        }
      }
      // flash-style, `width` rows in the lanes (on 8 lanes: contexts past rows_gemm's keys)
      if (kc.empty()) kc.resize(d64::kKeysPerPiece * 64), vc.resize(d64::kKeysPerPiece * 64);
      if (qt.size() < static_cast<size_t>(G * 64 * width))
        qt.resize(G * 64 * width), ot.resize(G * 64 * width), stats.resize(G * 2 * width);
      for (int64_t i = 0; i < nrow; i += width) {
        const int64_t n = std::min(width, nrow - i);
        if (width == 16) {
          if constexpr (d64::kHave16)
            d64::rows_d64<16>(q0 + i * q_row, q_row, o0 + i * Hq * D, Hq * D, K, V, row_off.data(), n, first + i,
                              w.head_lo, w.head_hi, G, sc, kc.data(), vc.data(), qt.data(), ot.data(), stats.data());
        } else if constexpr (d64::kHave8) {
          d64::rows_d64<8>(q0 + i * q_row, q_row, o0 + i * Hq * D, Hq * D, K, V, row_off.data(), n, first + i,
                           w.head_lo, w.head_hi, G, sc, kc.data(), vc.data(), qt.data(), ot.data(), stats.data());
        }
      }
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
  const int64_t per_item = amx ? tallyserve_amx::kRowsPerItem : (width == 8 ? d64::kGemmRows : kRowsPerItem);
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
  const bool built = width == 0 || (width == 8 && d64::kHave8) || (width == 16 && d64::kHave16);
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
