// tallyserve CPU paged attention: attention straight from the paged KV cache, no gathered copies.
//
// q: (T, Hq, D) float32; kv_cache: (2, num_blocks, block_size, Hkv, D) float32, both contiguous;
// block_tables: (R, max_blocks) int32; query_start_loc: (R + 1) int64; seq_lens: (R) int64.
// Request r owns query rows [query_start_loc[r], query_start_loc[r + 1]), at positions
// [seq_len - rows, seq_len); row at position p attends keys 0..p (causal). Returns (T, Hq, D).
//
// One work item is (request, KV head, a run of up to 8 query rows): the query heads that share that KV
// head read each K/V row once together. Scores are kept whole per row (exact softmax: max, exp, sum in
// float32, like the reference), then the weighted V rows are summed. Items run on ATen's thread pool.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kRowsPerItem = 8;

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float* y, const float* x, float w, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

struct Item {
  int64_t req, kv_head, row_lo, row_hi;
};

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous float32 (T, Hq, D)");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.scalar_type() == at::kFloat && kv_cache.is_contiguous(),
              "kv_cache: contiguous float32 (2, blocks, block_size, Hkv, D)");
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
  std::vector<Item> items;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t rows = qsl[r + 1] - qsl[r];
    TORCH_CHECK(rows >= 0 && rows <= sl[r] && qsl[r + 1] <= T, "request ", r, ": bad query rows or length");
    TORCH_CHECK((sl[r] + BS - 1) / BS <= MB, "request ", r, ": seq_len past its block table");
    for (int64_t b = 0; b < (sl[r] + BS - 1) / BS; ++b)
      TORCH_CHECK(bt[r * MB + b] >= 0 && bt[r * MB + b] < NB, "request ", r, ": block id out of range");
    for (int64_t lo = 0; lo < rows; lo += kRowsPerItem)
      for (int64_t g = 0; g < Hkv; ++g) items.push_back({r, g, lo, std::min(rows, lo + kRowsPerItem)});
  }

  at::Tensor out = at::zeros_like(q);
  const float* Q = q.data_ptr<float>();
  const float* K = kv_cache.data_ptr<float>();
  const float* V = K + NB * BS * Hkv * D;
  float* O = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t row_stride = Hkv * D;  // floats between consecutive positions of one block

  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t it = begin; it < end; ++it) {
      const Item& w = items[it];
      const int64_t len = sl[w.req], rows = qsl[w.req + 1] - qsl[w.req];
      const int32_t* blocks = bt + w.req * MB;
      const int64_t nkeys = len - rows + w.row_hi;  // keys the last row of this item sees
      const int64_t nrow = w.row_hi - w.row_lo;
      scores.assign(static_cast<size_t>(nrow * G * nkeys), 0.f);
      // scores[(i * G + h) * nkeys + j] = q_i,h . k_j * scale, for keys j the row may see
      for (int64_t j = 0; j < nkeys; ++j) {
        const float* kr = K + (static_cast<int64_t>(blocks[j / BS]) * BS + j % BS) * row_stride + w.kv_head * D;
        for (int64_t i = 0; i < nrow; ++i) {
          const int64_t pos = len - rows + w.row_lo + i;
          if (j > pos) continue;
          const float* qr = Q + (qsl[w.req] + w.row_lo + i) * Hq * D + w.kv_head * G * D;
          for (int64_t h = 0; h < G; ++h) scores[(i * G + h) * nkeys + j] = dot(qr + h * D, kr, D) * sc;
        }
      }
      for (int64_t i = 0; i < nrow; ++i) {
        const int64_t n = len - rows + w.row_lo + i + 1;
        for (int64_t h = 0; h < G; ++h) {
          float* s = scores.data() + (i * G + h) * nkeys;
          float mx = -INFINITY;
          for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
          float sum = 0.f;
          for (int64_t j = 0; j < n; ++j) {
            s[j] = std::exp(s[j] - mx);
            sum += s[j];
          }
          const float inv = 1.f / sum;
          for (int64_t j = 0; j < n; ++j) s[j] *= inv;
        }
      }
      for (int64_t j = 0; j < nkeys; ++j) {
        const float* vr = V + (static_cast<int64_t>(blocks[j / BS]) * BS + j % BS) * row_stride + w.kv_head * D;
        for (int64_t i = 0; i < nrow; ++i) {
          if (j > len - rows + w.row_lo + i) continue;
          float* orow = O + (qsl[w.req] + w.row_lo + i) * Hq * D + w.kv_head * G * D;
          for (int64_t h = 0; h < G; ++h) axpy(orow + h * D, vr, scores[(i * G + h) * nkeys + j], D);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tallyserve_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tallyserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
