// tallyserve CPU: float32 products x @ w^T on AVX2 + FMA, for CPUs without AVX-512 where the libraries' float32
// matmuls ran at 55-75% of the FMA peak on the model's shapes (oneDNN's brgemm on a 2-core AMD EPYC Zen 3: 113 of
// 179 GFLOP/s for 8,192 x 576 x 3,072).
//
//   pack_sgemm_weight(w)        w (N, K) float32 -> (ceil(N / 16), K, 16): 16 output features side by side per k
//                               (zero columns past N), so the kernel reads each panel as one stream.
//   linear_sgemm(x, packed, N)  x (M, K) float32 contiguous -> (M, N) = x @ w^T.
//
// The kernel: a 6 x 16 tile of the output in twelve 8-lane registers, each k one broadcast of six x values and two
// loads of the panel (the classic Haswell-era register block), four k per loop turn, over the whole of K, then
// stored once (blocking K and adding partial tiles back into the output sent them through memory again).
// Blocking: panels in groups of kGroupBytes (read from memory once per task, then from L2), rows in blocks of kMc
// (their x rows stay in L1 / L2 across a group's panels). Work: tasks of kTaskRows rows, the panels split too when
// there are few rows (decode), taken by ATen's threads from a shared counter.
// Sums run over k in order, one FMA at a time, so the results do not depend on the thread count or the blocking
// of rows and panels (they may differ from the libraries' in the last bits).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "fused_ops_cpu.h"
#include "task_pool_cpu.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kNr = 16;   // output features per panel
constexpr int64_t kMr = 6;    // output rows per register tile
constexpr int64_t kMc = 72;   // rows per block: a block's x rows stay in L1 / L2 across a group of panels
constexpr int64_t kTaskRows = 512;  // rows per task when there are many (prompt chunks)
constexpr int64_t kTasksPerThread = 4;  // at least this many tasks per thread where the panels allow
constexpr int64_t kGroupBytes = 256 << 10;  // panels read together: half of a Zen 3 / Skylake core's L2

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kBuilt = true;

// C[0:MR, 0:16] = A[0:MR, 0:kc] @ Bp[0:kc, 0:16]; A rows lda apart, C rows ldc apart; only the first `cols`
// columns of C are stored (a last panel past N).
template <int MR>
inline void tile(const float* A, int64_t lda, const float* Bp, float* C, int64_t ldc, int64_t kc, int64_t cols) {
  // (every loop over r unrolled: the sums must stay in registers)
  __m256 c0[MR], c1[MR];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {  // (four k per loop turn: 75 instead of 67 GFLOP/s of 89 on one Zen 3 core)
    const __m256 b0 = _mm256_loadu_ps(Bp + k * kNr), b1 = _mm256_loadu_ps(Bp + k * kNr + 8);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(A + r * lda + k);
      c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
    }
  }
  if (cols == kNr) {
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      float* cr = C + r * ldc;
      _mm256_storeu_ps(cr, c0[r]);
      _mm256_storeu_ps(cr + 8, c1[r]);
    }
    return;
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    alignas(32) float t[kNr];
    _mm256_store_ps(t, c0[r]);
    _mm256_store_ps(t + 8, c1[r]);
    float* cr = C + r * ldc;
    for (int64_t j = 0; j < cols; ++j) cr[j] = t[j];
  }
}

inline void tile_rows(int64_t rows, const float* A, int64_t lda, const float* Bp, float* C, int64_t ldc, int64_t kc,
                      int64_t cols) {
  switch (rows) {
    case 6: tile<6>(A, lda, Bp, C, ldc, kc, cols); break;
    case 5: tile<5>(A, lda, Bp, C, ldc, kc, cols); break;
    case 4: tile<4>(A, lda, Bp, C, ldc, kc, cols); break;
    case 3: tile<3>(A, lda, Bp, C, ldc, kc, cols); break;
    case 2: tile<2>(A, lda, Bp, C, ldc, kc, cols); break;
    default: tile<1>(A, lda, Bp, C, ldc, kc, cols); break;
  }
}
#else
constexpr bool kBuilt = false;
inline void tile_rows(int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t, int64_t) {}
#endif

// Rows [m0, m1) x panels [p0, p1) of C = A @ W^T, in groups of panels that fit half of L2 (read from memory once
// per task), each group for every block of kMc rows (their x rows stay in L1 / L2 across the group's panels), each
// 6 x 16 tile over the whole of K in registers and stored once.
void run_task(const float* A, const float* Bpack, float* C, int64_t K, int64_t N, int64_t m0, int64_t m1, int64_t p0,
              int64_t p1) {
  const int64_t group = std::max<int64_t>(1, kGroupBytes / (K * kNr * static_cast<int64_t>(sizeof(float))));
  for (int64_t g0 = p0; g0 < p1; g0 += group) {
    const int64_t g1 = std::min(p1, g0 + group);
    for (int64_t b0 = m0; b0 < m1; b0 += kMc) {
      const int64_t b1 = std::min(m1, b0 + kMc);
      for (int64_t p = g0; p < g1; ++p) {
        const int64_t cols = std::min(kNr, N - p * kNr);
        for (int64_t r = b0; r < b1; r += kMr)
          tile_rows(std::min(kMr, b1 - r), A + r * K, K, Bpack + p * K * kNr, C + r * N + p * kNr, N, K, cols);
      }
    }
  }
}

at::Tensor pack_sgemm_weight(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2,
              "pack_sgemm_weight: a float32 CPU matrix (N, K)");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), P = (N + kNr - 1) / kNr;
  at::Tensor out = at::zeros({P, K, kNr}, wc.options());
  const float* W = wc.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      for (int64_t j = 0; j < std::min(kNr, N - p * kNr); ++j) {
        const float* wr = W + (p * kNr + j) * K;
        for (int64_t k = 0; k < K; ++k) O[(p * K + k) * kNr + j] = wr[k];
      }
  });
  return out;
}

bool sgemm_built() { return kBuilt; }

}  // namespace

namespace tallyserve_cpu_ops {

at::Tensor linear_sgemm(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(kBuilt, "linear_sgemm: this build has no AVX2 + FMA");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "linear_sgemm: x must be a contiguous float32 CPU matrix (M, K)");
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(2) == kNr &&
                  packed.is_contiguous() && packed.size(1) == x.size(1),
              "linear_sgemm: packed must come from pack_sgemm_weight of a (N, K) weight with x's K");
  TORCH_CHECK(N > 0 && (N + kNr - 1) / kNr == packed.size(0), "linear_sgemm: N does not match the packed panels");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const float* A = x.data_ptr<float>();
  const float* B = packed.data_ptr<float>();
  float* C = out.data_ptr<float>();
  // tasks: rows in pieces of kTaskRows, the panels split too until there are kTasksPerThread per thread (decode
  // rows: each task streams its share of the weight once). Threads take tasks from a shared counter as they finish,
  // so one the OS deschedules (a busy neighbour) holds up its current task only (run_tasks, task_pool_cpu.h).
  const int64_t threads = task_threads();
  const int64_t row_tasks = (M + kTaskRows - 1) / kTaskRows;
  const int64_t want = kTasksPerThread * threads;
  const int64_t panel_tasks = row_tasks >= want ? 1 : std::min(P, (want + row_tasks - 1) / row_tasks);
  const int64_t per_task = (P + panel_tasks - 1) / panel_tasks;
  run_tasks(row_tasks * panel_tasks, [&](int64_t t) {
    const int64_t rt = t / panel_tasks, pt = t % panel_tasks;
    const int64_t p0 = pt * per_task, p1 = std::min(P, p0 + per_task);
    if (p0 < p1) run_task(A, B, C, K, N, rt * kTaskRows, std::min(M, rt * kTaskRows + kTaskRows), p0, p1);
  });
  return out;
}

}  // namespace tallyserve_cpu_ops

TORCH_LIBRARY_FRAGMENT(tallyserve_cpu, m) {
  m.def("pack_sgemm_weight(Tensor w) -> Tensor");
  m.def("linear_sgemm(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("sgemm_built() -> bool", &sgemm_built);
}

TORCH_LIBRARY_IMPL(tallyserve_cpu, CPU, m) {
  m.impl("pack_sgemm_weight", &pack_sgemm_weight);
  m.impl("linear_sgemm", &tallyserve_cpu_ops::linear_sgemm);
}
