// tallyserve CPU fused operators (float32): the CPU side of models/fused_ops.py and of the KV-cache write.
//
// A decode step of one sequence runs a few dozen small operators per layer; as separate PyTorch operators
// each costs a dispatch, an allocation and a pass over memory. These do each job in one pass:
//   add_rms_norm      residual += x (in place), out = weight * rms_norm(residual)   (or of x, no residual)
//   rotary_           rotate-half RoPE in place over (T, H, D) with per-token cos/sin (T, D)
//   qk_norm_rotary_   per-head RMSNorm (q weight on the first Hq heads, k weight on the rest), then RoPE
//   write_kv_cache_   k/v rows into their flat cache slots (slot < 0 skipped), non-finite values stored as 0;
//                     returns how many values were non-finite
// The arithmetic follows the PyTorch reference expressions in the same order (no fused multiply-add
// contraction), so results match them to rounding of the sum of squares. (SiLU-and-multiply stays two
// PyTorch operators on the CPU: its vectorized exp measured faster than a compiled loop here.)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_math.h"

#define TS_NO_CONTRACT __attribute__((optimize("fp-contract=off")))

namespace {

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

TS_NO_CONTRACT at::Tensor add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                       const at::Tensor& weight, double eps) {
  check_f32(x, "x");
  check_f32(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous (T, N)");
  const int64_t T = x.size(0), N = x.size(1);
  TORCH_CHECK(weight.numel() == N && weight.is_contiguous(), "weight: (N,)");
  float* R = nullptr;
  if (residual.has_value() && residual->defined()) {
    check_f32(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous(), "residual: contiguous, as x");
    R = residual->data_ptr<float>();
  }
  at::Tensor out = at::empty_like(x);
  const float* X = x.data_ptr<float>();
  const float* W = weight.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1)), [&](int64_t b, int64_t e) {
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
  at::parallel_for(0, T * H, std::max<int64_t>(1, 8192 / D), [&](int64_t b, int64_t e) {
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
  at::parallel_for(0, T * H, std::max<int64_t>(1, 8192 / D), [&](int64_t b, int64_t e) {
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

inline int64_t copy_finite(float* dst, const float* src, int64_t n) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool ok = std::isfinite(src[i]);
    bad += !ok;
    dst[i] = ok ? src[i] : 0.0f;
  }
  return bad;
}

int64_t write_kv_cache_(const at::Tensor& k, const at::Tensor& v, at::Tensor kv_cache, const at::Tensor& slot_mapping) {
  check_f32(k, "k");
  check_f32(v, "v");
  check_f32(kv_cache, "kv_cache");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache: contiguous (2, num_blocks, block_size, Hkv, D)");
  const int64_t slots = kv_cache.size(1) * kv_cache.size(2), H = kv_cache.size(3), D = kv_cache.size(4);
  TORCH_CHECK(k.dim() == 3 && k.size(1) == H && k.size(2) == D && k.stride(2) == 1, "k: (T, Hkv, D)");
  TORCH_CHECK(v.sizes() == k.sizes() && v.stride(2) == 1, "v: as k");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) >= k.size(0), "slot_mapping: (T,) or longer");
  const at::Tensor sm = slot_mapping.to(at::kLong).contiguous();
  const int64_t* slot = sm.data_ptr<int64_t>();
  const int64_t T = k.size(0);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] < slots, "slot ", slot[t], " is past the cache's ", slots, " slots");
  float* Kc = kv_cache.data_ptr<float>();
  float* Vc = Kc + slots * H * D;
  const float* K = k.data_ptr<float>();
  const float* V = v.data_ptr<float>();
  std::atomic<int64_t> nonfinite{0};
  at::parallel_for(0, T, std::max<int64_t>(1, 8192 / std::max<int64_t>(H * D, 1)), [&](int64_t b, int64_t e) {
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(tallyserve_cpu, m) {
  m.def("add_rms_norm(Tensor x, Tensor(a!)? residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("qk_norm_rotary_(Tensor(a!) qk, Tensor q_weight, Tensor k_weight, int num_q_heads, float eps, Tensor cos, "
        "Tensor sin) -> ()");
  m.def("write_kv_cache_(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping) -> int");
}

TORCH_LIBRARY_IMPL(tallyserve_cpu, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("qk_norm_rotary_", &qk_norm_rotary_);
  m.impl("write_kv_cache_", &write_kv_cache_);
}
