// Helpers of tallyserve's float32 CPU attention (paged_attention_cpu.cpp's generic loop, attention_d64_cpu.cpp):
// cached values read as float32 from a float32 or bfloat16 cache, dot products, the softmax (on 16 masked lanes
// with AVX-512).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tallyserve_attention_vec {

// A cached K/V value as float32: the cache holds float32, or bfloat16 bits (dtype="bfloat16" on the CPU).
inline float kv_value(const float* p, int64_t i) { return p[i]; }
inline float kv_value(const uint16_t* p, int64_t i) {
  const uint32_t u = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <typename KvT>
inline float dot(const float* a, const KvT* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * kv_value(b, i);
  return acc;
}

template <typename KvT>
inline void axpy(float* y, const KvT* x, float w, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += w * kv_value(x, i);
}

// exp(x) for the softmax's x = score - max <= 0 (cpu_math.h: vectorizable, within 2 ulp of expf).
inline float exp_nonpositive(float x) { return tallyserve_cpu_math::exp_float(x); }

// Softmax of n scores in place, in float32 like the reference: max, exp, sum, scale.
inline void softmax_inplace(float* s, int64_t n) {
#if defined(__AVX512F__)
  __m512 mx16 = _mm512_set1_ps(s[0]);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - j)) - 1);
    mx16 = _mm512_mask_max_ps(mx16, m, mx16, _mm512_maskz_loadu_ps(m, s + j));
  }
  const __m512 mxv = _mm512_set1_ps(_mm512_reduce_max_ps(mx16));
  __m512 sum16 = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 e = tallyserve_cpu_math::exp_vec<16>(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), mxv));
    sum16 = _mm512_mask_add_ps(sum16, m, sum16, e);
    _mm512_mask_storeu_ps(s + j, m, e);
  }
  const __m512 inv16 = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum16));
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - j)) - 1);
    _mm512_mask_storeu_ps(s + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + j), inv16));
  }
#else
  float mx = s[0];
#pragma omp simd reduction(max : mx)
  for (int64_t j = 1; j < n; ++j) mx = std::max(mx, s[j]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    s[j] = exp_nonpositive(s[j] - mx);
    sum += s[j];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) s[j] *= inv;
#endif
}

}  // namespace tallyserve_attention_vec
