// tallyserve CPU fused operators (float32): the CPU side of kernels/fused_ops.py and of the KV-cache write.
//
// A decode step of one sequence runs a few dozen small operators per layer; as separate PyTorch operators
// each costs a dispatch, an allocation and a pass over memory. These do each job in one pass:
//   add_rms_norm      residual += x (in place), out = weight * rms_norm(residual)   (or of x, no residual)
//   rotary_           rotate-half RoPE in place over (T, H, D) with per-token cos/sin (T, D)
//   qk_norm_rotary_   per-head RMSNorm (q weight on the first Hq heads, k weight on the rest), then RoPE
//   write_kv_cache_   k/v rows into their flat cache slots (slot < 0 skipped), non-finite values stored as 0;
//                     returns how many values were non-finite; a bfloat16 cache gets the values rounded
// and, for dtype="bfloat16" on the CPU (bfloat16 projections in a float32 model), two that hand the next
// matmul its bfloat16 input directly, with float32 arithmetic inside and one rounding at the end:
//   add_rms_norm_bf16 add_rms_norm of a float32 or bfloat16 x into the float32 residual; bfloat16 out
//   silu_mul_bf16     silu(gate) * up of a bfloat16 [gate | up] (T, 2N); bfloat16 (T, N) out
//   gemv_bf16         x (M <= 4, K) @ w (N, K)^T in bfloat16 with float32 sums (AVX512-BF16 dot products), rounded
//                     to bfloat16 like the library matmul: its kernels for one to four rows ran below the float32
//                     matmul's speed, this one streams the half-size weights at memory speed
// (argmax_rows and mask_logits_rows_, the sampler's, are in sampling_ops_cpu.cpp.)
// The arithmetic follows the PyTorch reference expressions in the same order (no fused multiply-add
// contraction), so results match them to rounding of the sum of squares. (SiLU-and-multiply stays two
// PyTorch operators on the CPU: its vectorized exp measured faster than a compiled loop here.)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_math.h"
#include "fused_ops_cpu.h"
#include "task_pool_cpu.h"

#define TS_NO_CONTRACT __attribute__((optimize("fp-contract=off")))

namespace tallyserve_cpu_ops {

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, ": a float32 CPU tensor");
}

TS_NO_CONTRACT float inv_rms(const float* x, int64_t n, double eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float mean = ss / static_cast<float>(n);
  return 1.0f / std::sqrt(mean + static_cast<float>(eps));
}

// The checks both add_rms_norm operators share; the residual's data, or nullptr without one.
float* checked_residual(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight) {
  check_f32(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous (T, N)");
  TORCH_CHECK(weight.numel() == x.size(1) && weight.is_contiguous(), "weight: (N,)");
  if (!residual.has_value() || !residual->defined()) return nullptr;
  check_f32(*residual, "residual");
  TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous(), "residual: contiguous, as x");
  return residual->data_ptr<float>();
}

TS_NO_CONTRACT at::Tensor add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                       const at::Tensor& weight, double eps) {
  check_f32(x, "x");
  float* R = checked_residual(x, residual, weight);
  const int64_t T = x.size(0), N = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* X = x.data_ptr<float>();
  const float* W = weight.data_ptr<float>();
  float* O = out.data_ptr<float>();
  tallyserve_cpu_ops::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1)), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* src = X + t * N;
      if (R) {
        float* r = R + t * N;
        for (int64_t i = 0; i < N; ++i) r[i] = src[i] + r[i];
        src = r;
      }
      const float inv = inv_rms(src, N, eps);
      float* o = O + t * N;
      for (int64_t i = 0; i < N; ++i) o[i] = W[i] * (src[i] * inv);
    }
  });
  return out;
}

// One head row of D values: rotate-half RoPE in place (x1' = x1*c - x2*s, x2' = x2*c + x1*s).
TS_NO_CONTRACT inline void rotate_row(float* x, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * c[i] + (-b) * s[i];
    x[i + half] = b * c[i + half] + a * s[i + half];
  }
}

void check_rope_args(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_f32(x, "x");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x: (T, H, D) with a contiguous last dimension");
  TORCH_CHECK(x.size(2) % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) && cos.stride(1) == 1,
              "cos: (T, D)");
  TORCH_CHECK(sin.sizes() == cos.sizes() && sin.stride(1) == 1 && sin.stride(0) == cos.stride(0), "sin: as cos");
}

void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rope_args(x, cos, sin);
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  const int64_t st = x.stride(0), sh = x.stride(1), sc = cos.stride(0);
  float* X = x.data_ptr<float>();
  const float* C = cos.data_ptr<float>();
  const float* S = sin.data_ptr<float>();
  tallyserve_cpu_ops::parallel_for(0, T * H, std::max<int64_t>(1, 8192 / D), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = i / H, h = i % H;
      rotate_row(X + t * st + h * sh, C + t * sc, S + t * sc, half);
    }
  });
}

TS_NO_CONTRACT void qk_norm_rotary_(at::Tensor qk, const at::Tensor& q_weight, const at::Tensor& k_weight,
                                    int64_t num_q_heads, double eps, const at::Tensor& cos, const at::Tensor& sin) {
  check_rope_args(qk, cos, sin);
  check_f32(q_weight, "q_weight");
  check_f32(k_weight, "k_weight");
  const int64_t T = qk.size(0), H = qk.size(1), D = qk.size(2), half = D / 2;
  TORCH_CHECK(q_weight.numel() == D && k_weight.numel() == D, "q/k norm weights: (D,)");
  TORCH_CHECK(num_q_heads > 0 && num_q_heads < H, "num_q_heads must leave at least one k head");
  const int64_t st = qk.stride(0), sh = qk.stride(1), sc = cos.stride(0);
  float* X = qk.data_ptr<float>();
  const float* QW = q_weight.contiguous().data_ptr<float>();
  const float* KW = k_weight.contiguous().data_ptr<float>();
  const float* C = cos.data_ptr<float>();
  const float* S = sin.data_ptr<float>();
  tallyserve_cpu_ops::parallel_for(0, T * H, std::max<int64_t>(1, 8192 / D), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = i / H, h = i % H;
      float* x = X + t * st + h * sh;
      const float* w = h < num_q_heads ? QW : KW;
      const float inv = inv_rms(x, D, eps);
      for (int64_t d = 0; d < D; ++d) x[d] = w[d] * (x[d] * inv);
      rotate_row(x, C + t * sc, S + t * sc, half);
    }
  });
}

// bfloat16 <-> float32 as PyTorch converts (round to nearest even, NaN kept), in plain integer arithmetic
// so the loops vectorize.
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>(0x7fc0u) : static_cast<uint16_t>(rounded);
}

inline float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float load_f(const float* p, int64_t i) { return p[i]; }
inline float load_f(const uint16_t* p, int64_t i) { return from_bf16(p[i]); }

template <typename In>
TS_NO_CONTRACT void add_rms_norm_bf16_rows(const In* X, float* R, const float* W, uint16_t* O, int64_t T, int64_t N,
                                           double eps) {
  tallyserve_cpu_ops::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1)), [&](int64_t b, int64_t e) {
    std::vector<float> row(static_cast<size_t>(N));
    for (int64_t t = b; t < e; ++t) {
      const In* src = X + t * N;
      float* r = R ? R + t * N : row.data();
      if (R) {
        for (int64_t i = 0; i < N; ++i) r[i] = load_f(src, i) + r[i];
      } else {
        for (int64_t i = 0; i < N; ++i) r[i] = load_f(src, i);
      }
      const float inv = inv_rms(r, N, eps);
      uint16_t* o = O + t * N;
      for (int64_t i = 0; i < N; ++i) o[i] = to_bf16(W[i] * (r[i] * inv));
    }
  });
}

at::Tensor add_rms_norm_bf16(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                             double eps) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x: a float32 or bfloat16 CPU tensor");
  float* R = checked_residual(x, residual, weight);
  const int64_t T = x.size(0), N = x.size(1);
  at::Tensor out = at::empty({T, N}, x.options().dtype(at::kBFloat16));
  uint16_t* O = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* W = weight.data_ptr<float>();
  if (x.scalar_type() == at::kFloat)
    add_rms_norm_bf16_rows(x.data_ptr<float>(), R, W, O, T, N, eps);
  else
    add_rms_norm_bf16_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), R, W, O, T, N, eps);
  return out;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 load_bf16x16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

inline void store_bf16x16(uint16_t* p, __m512 v, __mmask16 m) {
  const __m512i u = _mm512_castps_si512(v);  // round to nearest even; NaN -> 0x7fc0, as to_bf16
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
}

inline void silu_mul_row_bf16(const uint16_t* g, uint16_t* o, int64_t N) {
  const uint16_t* u = g + N;
  for (int64_t i = 0; i < N; i += 16) {
    const __mmask16 m = N - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (N - i)) - 1);
    const __m512 x = load_bf16x16(g + i, m);
    const __m512 act = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), tallyserve_cpu_math::exp_vec<16>(_mm512_sub_ps(_mm512_setzero_ps(), x))));
    store_bf16x16(o + i, _mm512_mul_ps(act, load_bf16x16(u + i, m)), m);
  }
}
#else
inline void silu_mul_row_bf16(const uint16_t* g, uint16_t* o, int64_t N) {
  const uint16_t* u = g + N;
  for (int64_t i = 0; i < N; ++i) {
    const float x = from_bf16(g[i]);
    o[i] = to_bf16(x / (1.0f + tallyserve_cpu_math::exp_float(-x)) * from_bf16(u[i]));
  }
}
#endif

at::Tensor silu_mul_bf16(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == at::kBFloat16, "gate_up: a bfloat16 CPU tensor");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, "gate_up: contiguous (T, 2N)");
  const int64_t T = gate_up.size(0), N = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T, N}, gate_up.options());
  const uint16_t* G = reinterpret_cast<const uint16_t*>(gate_up.data_ptr<at::BFloat16>());
  uint16_t* O = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  tallyserve_cpu_ops::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1)), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) silu_mul_row_bf16(G + t * 2 * N, O + t * N, N);
  });
  return out;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

template <int M>
void gemv_rows(const uint16_t* X, const uint16_t* W, uint16_t* O, int64_t N, int64_t K, int64_t n_lo, int64_t n_hi) {
  for (int64_t n0 = n_lo; n0 < n_hi; n0 += 4) {
    const int R = static_cast<int>(std::min<int64_t>(4, n_hi - n0));
    __m512 acc[M][4];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      const __mmask32 mask = K - k >= 32 ? ~static_cast<__mmask32>(0) : (static_cast<__mmask32>(1) << (K - k)) - 1;
      __m512bh xv[M];
      for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, X + m * K + k);
      for (int r = 0; r < R; ++r) {
        // the rows four blocks ahead, so they arrive from memory in time (the hardware prefetcher alone
        // left the kernel at about half the memory bandwidth)
        if (n0 + 16 + r < n_hi) _mm_prefetch(reinterpret_cast<const char*>(W + (n0 + 16 + r) * K + k), _MM_HINT_T0);
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, W + (n0 + r) * K + k);
        for (int m = 0; m < M; ++m) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv[m], wv);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) O[m * N + n0 + r] = to_bf16(_mm512_reduce_add_ps(acc[m][r]));
  }
}

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && x.scalar_type() == at::kBFloat16 &&
              w.scalar_type() == at::kBFloat16, "gemv_bf16: bfloat16 CPU tensors");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.is_contiguous() && w.is_contiguous(),
              "gemv_bf16: contiguous x (M, K) and w (N, K)");
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  TORCH_CHECK(M >= 1 && M <= kGemvMaxRows, "gemv_bf16: 1 to ", kGemvMaxRows, " rows");
  at::Tensor out = at::empty({M, N}, x.options());
  const uint16_t* X = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* W = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* O = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // blocks of 4 output rows; about 64 KiB of weights per task
  const int64_t blocks = (N + 3) / 4, grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(K, 1));
  tallyserve_cpu_ops::parallel_for(0, blocks, grain, [&](int64_t b, int64_t e) {
    const int64_t lo = b * 4, hi = std::min(N, e * 4);
    switch (M) {
      case 1: gemv_rows<1>(X, W, O, N, K, lo, hi); break;
      case 2: gemv_rows<2>(X, W, O, N, K, lo, hi); break;
      case 3: gemv_rows<3>(X, W, O, N, K, lo, hi); break;
      default: gemv_rows<4>(X, W, O, N, K, lo, hi); break;
    }
  });
  return out;
}
#endif

inline int64_t copy_finite(float* dst, const float* src, int64_t n) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool ok = std::isfinite(src[i]);
    bad += !ok;
    dst[i] = ok ? src[i] : 0.0f;
  }
  return bad;
}

inline int64_t copy_finite(uint16_t* dst, const float* src, int64_t n) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool ok = std::isfinite(src[i]);
    bad += !ok;
    dst[i] = ok ? to_bf16(src[i]) : static_cast<uint16_t>(0);
  }
  return bad;
}

template <typename KvT>
int64_t write_rows(const at::Tensor& k, const at::Tensor& v, KvT* Kc, const int64_t* slot, int64_t slots, int64_t H,
                   int64_t D) {
  KvT* Vc = Kc + slots * H * D;
  const float* K = k.data_ptr<float>();
  const float* V = v.data_ptr<float>();
  const int64_t T = k.size(0);
  std::atomic<int64_t> nonfinite{0};
  tallyserve_cpu_ops::parallel_for(0, T, std::max<int64_t>(1, 8192 / std::max<int64_t>(H * D, 1)), [&](int64_t b, int64_t e) {
    int64_t bad = 0;
    for (int64_t t = b; t < e; ++t) {
      if (slot[t] < 0) continue;
      for (int64_t h = 0; h < H; ++h) {
        bad += copy_finite(Kc + (slot[t] * H + h) * D, K + t * k.stride(0) + h * k.stride(1), D);
        bad += copy_finite(Vc + (slot[t] * H + h) * D, V + t * v.stride(0) + h * v.stride(1), D);
      }
    }
    nonfinite += bad;
  });
  return nonfinite.load();
}

int64_t write_kv_cache_(const at::Tensor& k, const at::Tensor& v, at::Tensor kv_cache, const at::Tensor& slot_mapping) {
  check_f32(k, "k");
  check_f32(v, "v");
  TORCH_CHECK(kv_cache.device().is_cpu() &&
                  (kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16),
              "kv_cache: a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache: contiguous (2, num_blocks, block_size, Hkv, D)");
  const int64_t slots = kv_cache.size(1) * kv_cache.size(2), H = kv_cache.size(3), D = kv_cache.size(4);
  TORCH_CHECK(k.dim() == 3 && k.size(1) == H && k.size(2) == D && k.stride(2) == 1, "k: (T, Hkv, D)");
  TORCH_CHECK(v.sizes() == k.sizes() && v.stride(2) == 1, "v: as k");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) >= k.size(0), "slot_mapping: (T,) or longer");
  const at::Tensor sm = slot_mapping.to(at::kLong).contiguous();
  const int64_t* slot = sm.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(slot[t] < slots, "slot ", slot[t], " is past the cache's ", slots, " slots");
  if (kv_cache.scalar_type() == at::kFloat) return write_rows(k, v, kv_cache.data_ptr<float>(), slot, slots, H, D);
  return write_rows(k, v, reinterpret_cast<uint16_t*>(kv_cache.data_ptr<at::BFloat16>()), slot, slots, H, D);
}

}  // namespace tallyserve_cpu_ops

using namespace tallyserve_cpu_ops;

TORCH_LIBRARY_FRAGMENT(tallyserve_cpu, m) {
  m.def("add_rms_norm(Tensor x, Tensor(a!)? residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("qk_norm_rotary_(Tensor(a!) qk, Tensor q_weight, Tensor k_weight, int num_q_heads, float eps, Tensor cos, "
        "Tensor sin) -> ()");
  m.def("write_kv_cache_(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping) -> int");
  m.def("add_rms_norm_bf16(Tensor x, Tensor(a!)? residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul_bf16(Tensor gate_up) -> Tensor");
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  m.def("gemv_bf16(Tensor x, Tensor w) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(tallyserve_cpu, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("qk_norm_rotary_", &qk_norm_rotary_);
  m.impl("write_kv_cache_", &write_kv_cache_);
  m.impl("add_rms_norm_bf16", &add_rms_norm_bf16);
  m.impl("silu_mul_bf16", &silu_mul_bf16);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  m.impl("gemv_bf16", &gemv_bf16);
#endif
}
