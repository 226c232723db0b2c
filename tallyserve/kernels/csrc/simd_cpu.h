// The float32 vectors that tallyserve's CPU kernels are written over once for both widths: Vec<8> (AVX2, 8 lanes)
// and Vec<16> (AVX-512, 16 lanes), each a set of static functions on its registers. A kernel written as
// `template <int W> ... using V = Vec<W>;` runs the same operations in the same order per lane at either width;
// each function here is one instruction (or the one fixed sequence) of its width, so the results are those of the
// intrinsics written out by hand. Defined where the build has the instructions: Vec<8> with AVX2 (its fmadd and
// fnmadd with FMA too), Vec<16> with AVX-512F.
//   reg, ireg   float32 and int32 registers; mask: a lane predicate (all-ones lanes on AVX2, a __mmask16 on AVX-512)
//   load        W floats, or W bfloat16 values (a bfloat16 cache's bits) widened to float32
#pragma once

#include <cstdint>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define TS_VEC_FN static inline __attribute__((always_inline))

namespace tallyserve_simd {

template <int W>
struct Vec;

#if defined(__AVX2__)
template <>
struct Vec<8> {
  using reg = __m256;
  using ireg = __m256i;
  using mask = __m256;
  static constexpr int width = 8;

  TS_VEC_FN reg load(const float* p) { return _mm256_loadu_ps(p); }
  TS_VEC_FN reg load(const uint16_t* p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  TS_VEC_FN void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  TS_VEC_FN reg zero() { return _mm256_setzero_ps(); }
  TS_VEC_FN reg set1(float x) { return _mm256_set1_ps(x); }
  TS_VEC_FN reg broadcast(const float* p) { return _mm256_broadcast_ss(p); }

  TS_VEC_FN reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  TS_VEC_FN reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  TS_VEC_FN reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  TS_VEC_FN reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
  TS_VEC_FN reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  TS_VEC_FN reg min(reg a, reg b) { return _mm256_min_ps(a, b); }
#if defined(__FMA__)
  TS_VEC_FN reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }   // a * b + c
  TS_VEC_FN reg fnmadd(reg a, reg b, reg c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b
#endif
  TS_VEC_FN reg floor(reg a) { return _mm256_floor_ps(a); }

  TS_VEC_FN ireg set1_i(int32_t x) { return _mm256_set1_epi32(x); }
  TS_VEC_FN ireg lanes_i() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }  // [0, 1, ..., 7]
  TS_VEC_FN ireg add_i(ireg a, ireg b) { return _mm256_add_epi32(a, b); }
  TS_VEC_FN ireg min_i(ireg a, ireg b) { return _mm256_min_epi32(a, b); }
  TS_VEC_FN ireg to_int(reg a) { return _mm256_cvtps_epi32(a); }  // rounded to nearest
  TS_VEC_FN reg exponent_bits(ireg e) { return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)); }  // 2^(e - 127)

  TS_VEC_FN mask gt_i(ireg a, ireg b) { return _mm256_castsi256_ps(_mm256_cmpgt_epi32(a, b)); }
  TS_VEC_FN mask neq(reg a, reg b) { return _mm256_cmp_ps(a, b, _CMP_NEQ_OQ); }
  TS_VEC_FN reg select(mask m, reg a, reg b) { return _mm256_blendv_ps(b, a, m); }  // m ? a : b
  TS_VEC_FN reg zero_unless(mask m, reg a) { return _mm256_and_ps(m, a); }        // m ? a : 0
  TS_VEC_FN bool any_nan(reg a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)) != 0; }
  TS_VEC_FN unsigned eq_bits(reg a, reg b) {  // bit i: lane i of a equals lane i of b
    return static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)));
  }

  TS_VEC_FN float hmax(reg v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  TS_VEC_FN float hsum(reg v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};
#endif

#if defined(__AVX512F__)
template <>
struct Vec<16> {
  using reg = __m512;
  using ireg = __m512i;
  using mask = __mmask16;
  static constexpr int width = 16;

  TS_VEC_FN reg load(const float* p) { return _mm512_loadu_ps(p); }
  TS_VEC_FN reg load(const uint16_t* p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  TS_VEC_FN void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  TS_VEC_FN reg zero() { return _mm512_setzero_ps(); }
  TS_VEC_FN reg set1(float x) { return _mm512_set1_ps(x); }
  TS_VEC_FN reg broadcast(const float* p) { return _mm512_set1_ps(*p); }

  TS_VEC_FN reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  TS_VEC_FN reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  TS_VEC_FN reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  TS_VEC_FN reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  TS_VEC_FN reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  TS_VEC_FN reg min(reg a, reg b) { return _mm512_min_ps(a, b); }
  TS_VEC_FN reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  TS_VEC_FN reg fnmadd(reg a, reg b, reg c) { return _mm512_fnmadd_ps(a, b, c); }
  TS_VEC_FN reg floor(reg a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }

  TS_VEC_FN ireg set1_i(int32_t x) { return _mm512_set1_epi32(x); }
  TS_VEC_FN ireg lanes_i() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  TS_VEC_FN ireg add_i(ireg a, ireg b) { return _mm512_add_epi32(a, b); }
  TS_VEC_FN ireg min_i(ireg a, ireg b) { return _mm512_min_epi32(a, b); }
  TS_VEC_FN ireg to_int(reg a) { return _mm512_cvtps_epi32(a); }
  TS_VEC_FN reg exponent_bits(ireg e) { return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23)); }

  TS_VEC_FN mask gt_i(ireg a, ireg b) { return _mm512_cmp_epi32_mask(a, b, _MM_CMPINT_NLE); }
  TS_VEC_FN mask neq(reg a, reg b) { return _mm512_cmp_ps_mask(a, b, _CMP_NEQ_OQ); }
  TS_VEC_FN reg select(mask m, reg a, reg b) { return _mm512_mask_blend_ps(m, b, a); }
  TS_VEC_FN reg zero_unless(mask m, reg a) { return _mm512_maskz_mov_ps(m, a); }
  TS_VEC_FN bool any_nan(reg a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0; }
  TS_VEC_FN unsigned eq_bits(reg a, reg b) { return static_cast<unsigned>(_mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ)); }

  TS_VEC_FN float hmax(reg v) { return _mm512_reduce_max_ps(v); }
  TS_VEC_FN float hsum(reg v) { return _mm512_reduce_add_ps(v); }
};
#endif

}  // namespace tallyserve_simd

#undef TS_VEC_FN
