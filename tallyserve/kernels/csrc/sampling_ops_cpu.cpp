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
#include "simd_cpu.h"
#include "task_pool_cpu.h"

namespace tallyserve_cpu_ops {

// argmax_row's vectors: the widest the build has (simd_cpu.h), or none
#if defined(__AVX512F__)
constexpr int kArgmaxLanes = 16;
#elif defined(__AVX2__)
constexpr int kArgmaxLanes = 8;
#else
constexpr int kArgmaxLanes = 0;
#endif

// The index of row x's first maximum (first NaN if any: NaN compares above everything, as in torch.max), on the
// vectors of W lanes (0: scalar code only).
template <int W>
int64_t argmax_row(const float* x, int64_t n) {
  int64_t j = 0;
  float best = -INFINITY;
  if constexpr (W > 0) {
    using V = tallyserve_simd::Vec<W>;
    typename V::reg top = V::set1(-INFINITY);
    for (; j + W <= n; j += W) {  // pass 1: the maximum, stopping at the first block with a NaN
      const typename V::reg v = V::load(x + j);
      if (V::any_nan(v)) break;
      top = V::max(top, v);
    }
    best = V::hmax(top);
  }
  for (int64_t k = j; k < n; ++k) {
    if (std::isnan(x[k])) return k;  // the first NaN (none before j: its blocks were checked)
    best = std::max(best, x[k]);
  }
  int64_t k = 0;  // pass 2: the first position holding it
  if constexpr (W > 0) {
    using V = tallyserve_simd::Vec<W>;
    const typename V::reg want = V::set1(best);
    for (; k + W <= n; k += W) {
      const unsigned hit = V::eq_bits(V::load(x + k), want);
      if (hit) return k + __builtin_ctz(hit);
    }
  }
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
    for (int64_t r = lo; r < hi; ++r) O[r] = argmax_row<kArgmaxLanes>(X + r * N, N);
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
