// Vector helpers of tallyserve's float32 CPU attention paths (paged_attention_cpu.cpp): cached values read as
// float32 from a float32 or bfloat16 cache, dot products, the softmax, and the AVX-512 pieces of the head_dim-64
// kernels.
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
    const __m512 e = tallyserve_cpu_math::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), mxv));
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

#if defined(__AVX512F__)
// The sums of eight vectors' lanes, as one vector: [sum(v[0]), ..., sum(v[7])].
inline __m256 hsum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// One head's 64 cached values into L1 (four 64-byte lines of float32, two of bfloat16).
template <typename KvT>
inline void prefetch_row(const KvT* p) {
  const char* c = reinterpret_cast<const char*>(p);
  for (size_t off = 0; off < 64 * sizeof(KvT); off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// 16 cached values as float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// The products of one head_dim-64 query (four registers) and key row, in 16 lanes.
template <typename KvT>
inline __m512 dot64(const __m512* qv, const KvT* kr) {
  __m512 acc = _mm512_mul_ps(qv[0], load16(kr));
  acc = _mm512_fmadd_ps(qv[1], load16(kr + 16), acc);
  acc = _mm512_fmadd_ps(qv[2], load16(kr + 32), acc);
  return _mm512_fmadd_ps(qv[3], load16(kr + 48), acc);
}

// The same, folded to 8 lanes.
template <typename KvT>
inline __m256 dot64_half(const __m512* qv, const KvT* kr) {
  const __m512 acc = dot64(qv, kr);
  return _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
}

#endif

}  // namespace tallyserve_attention_vec
