// tallyserve CPU operators of the sampler:
//   argmax_rows       each row's index of its first maximum (of its first NaN if it has one), as torch.max(dim=-1)
//                     and argmax find it, rows spread over the threads
//   mask_logits_rows_ logits row rows[k] gets -inf wherever bit t % 32 of words[k, t / 32] is clear (a grammar's
//                     token bitmask; tokens past the words' width are masked too), in place

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "fused_ops_cpu.h"
#include "task_pool_cpu.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tallyserve_cpu_ops {

// The index of row x's first maximum (first NaN if any: NaN compares above everything, as in torch.max).
int64_t argmax_row(const float* x, int64_t n) {
  int64_t j = 0;
  float best = -INFINITY;
#if defined(__AVX512F__)
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (; j + 16 <= n; j += 16) {  // pass 1: the maximum, stopping at the first block with a NaN
    const __m512 v = _mm512_loadu_ps(x + j);
    if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) break;
    top = _mm512_max_ps(top, v);
  }
  best = _mm512_reduce_max_ps(top);
#elif defined(__AVX2__)
  __m256 top = _mm256_set1_ps(-INFINITY);
  for (; j + 8 <= n; j += 8) {  // as above, 8 lanes
    const __m256 v = _mm256_loadu_ps(x + j);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) break;
    top = _mm256_max_ps(top, v);
  }
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  best = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
#endif
  for (int64_t k = j; k < n; ++k) {
    if (std::isnan(x[k])) return k;  // the first NaN (none before j: its blocks were checked)
    best = std::max(best, x[k]);
  }
  int64_t k = 0;  // pass 2: the first position holding it
#if defined(__AVX512F__)
  const __m512 want = _mm512_set1_ps(best);
  for (; k + 16 <= n; k += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + k), want, _CMP_EQ_OQ);
    if (hit) return k + __builtin_ctz(static_cast<unsigned>(hit));
  }
#elif defined(__AVX2__)
  const __m256 want = _mm256_set1_ps(best);
  for (; k + 8 <= n; k += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + k), want, _CMP_EQ_OQ));
    if (hit) return k + __builtin_ctz(static_cast<unsigned>(hit));
  }
#endif
  for (; k < n; ++k)
    if (x[k] == best) return k;
  return 0;  // n == 0 cannot happen (checked); a row of -inf is found at 0 above
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) > 0, "argmax_rows: contiguous float32 (R, N), N > 0");
  const int64_t R = x.size(0), N = x.size(1);
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  const float* X = x.data_ptr<float>();
  int64_t* O = out.data_ptr<int64_t>();
  // a row of 49,152 logits is ~12 us: rows in pieces of at least four per thread
  tallyserve_cpu_ops::parallel_for(0, R, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) O[r] = argmax_row(X + r * N, N);
  });
  return out;
}

void mask_logits_rows_(at::Tensor logits, const at::Tensor& words, const at::Tensor& rows) {
  check_f32(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits: 2-D with a contiguous last dimension");
  TORCH_CHECK(words.device().is_cpu() && words.scalar_type() == at::kInt && words.dim() == 2 && words.stride(1) == 1,
              "words: a 2-D int32 CPU tensor with a contiguous last dimension");
  TORCH_CHECK(rows.dim() == 1 && rows.numel() == words.size(0), "rows: one logits row index per bitmask row");
  const at::Tensor r = rows.to(at::kLong).contiguous();
  const int64_t* row = r.data_ptr<int64_t>();
  const int64_t n = rows.numel(), vocab = logits.size(1), num_words = words.size(1);
  for (int64_t k = 0; k < n; ++k)
    TORCH_CHECK(row[k] >= 0 && row[k] < logits.size(0), "row index ", row[k], " is outside the logits' ", logits.size(0), " rows");
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float* L = logits.data_ptr<float>();
  const int32_t* W = words.data_ptr<int32_t>();
  tallyserve_cpu_ops::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      float* out = L + row[k] * logits.stride(0);
      const int32_t* w = W + k * words.stride(0);
      for (int64_t base = 0; base < vocab; base += 32) {
        const int64_t wi = base / 32, len = std::min<int64_t>(32, vocab - base);
        const uint32_t bits = wi < num_words ? static_cast<uint32_t>(w[wi]) : 0u;
        if (bits == 0xffffffffu) continue;  // all allowed (the common word of an open grammar)
        if (bits == 0) {  // none allowed (the common word of a narrow one)
          std::fill(out + base, out + base + len, neg_inf);
          continue;
        }
        for (int64_t j = 0; j < len; ++j)
          if (!((bits >> j) & 1u)) out[base + j] = neg_inf;
      }
    }
  });
}

}  // namespace tallyserve_cpu_ops

using namespace tallyserve_cpu_ops;

TORCH_LIBRARY_FRAGMENT(tallyserve_cpu, m) {
  m.def("mask_logits_rows_(Tensor(a!) logits, Tensor words, Tensor rows) -> ()");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(tallyserve_cpu, CPU, m) {
  m.impl("mask_logits_rows_", &mask_logits_rows_);
  m.impl("argmax_rows", &argmax_rows);
}
