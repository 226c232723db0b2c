// Small float math for tallyserve's CPU kernels, written so the compiler vectorizes the loops that call it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd_cpu.h"

namespace tallyserve_cpu_math {

// exp(x) in plain float arithmetic (a libm call per element costs more than the loops around it):
// Cody-Waite reduction by ln 2 and a degree-6 polynomial, within 2 ulp of expf for x in [-87, 88];
// inputs are clamped to that range (below: about 1e-38 instead of 0; above: about 1.7e38 instead of inf).
inline float exp_float(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// exp_float on the W lanes of a simd_cpu.h vector (Vec<16>, or Vec<8> with FMA): the same reduction and
// polynomial. (Inside the operators, loops over exp_float vectorized but ran several times slower than the same
// loop compiled alone; this does not depend on it.)
template <int W>
inline typename tallyserve_simd::Vec<W>::reg exp_vec(typename tallyserve_simd::Vec<W>::reg x) {
  using V = tallyserve_simd::Vec<W>;
  x = V::min(V::max(x, V::set1(-87.0f)), V::set1(88.0f));
  const typename V::reg n = V::floor(V::fmadd(x, V::set1(1.44269504088896341f), V::set1(0.5f)));
  typename V::reg r = V::fnmadd(n, V::set1(0.693359375f), x);
  r = V::fmadd(n, V::set1(2.12194440e-4f), r);
  typename V::reg p = V::set1(1.9875691500e-4f);
  p = V::fmadd(p, r, V::set1(1.3981999507e-3f));
  p = V::fmadd(p, r, V::set1(8.3334519073e-3f));
  p = V::fmadd(p, r, V::set1(4.1665795894e-2f));
  p = V::fmadd(p, r, V::set1(1.6666665459e-1f));
  p = V::fmadd(p, r, V::set1(5.0000001201e-1f));
  p = V::fmadd(V::mul(p, r), r, V::add(r, V::set1(1.0f)));
  return V::mul(p, V::exponent_bits(V::add_i(V::to_int(n), V::set1_i(127))));
}
#endif

}  // namespace tallyserve_cpu_math
