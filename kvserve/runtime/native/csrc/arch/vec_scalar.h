// Portable code every instruction set shares: exp_approx and the float <-> bf16 conversions
// (the vector forms in vec_avx2.h / vec_avx512.h reproduce them bit for bit), and 8-float GCC
// vectors (v8f: the compiler maps them to AVX2, AVX-512 or NEON). Numerics: README.md.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvserve {

// Cephes-style expf: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p(r) = 1 + r + r^2 P(r)
// with P of degree 5. Pure arithmetic and integer bit tricks, so `#pragma omp simd` loops
// vectorize it (libm's expf is a scalar call). Inputs are clamped to [-87.34, 88.38]: below,
// the result is exp(-87.34) ~ 1.2e-38, the smallest normal float, instead of a denormal.
// Its constants, shared with its vector forms (exp16, exp8): the clamp, log2(e), ln2 split in
// two so that n * ln2 is subtracted without rounding loss, and P's coefficients, highest first.
constexpr float kExpMin = -87.33654f, kExpMax = 88.37626f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_approx(float x) {
  x = std::min(std::max(x, kExpMin), kExpMax);
  const float n = std::nearbyint(x * kLog2e);
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = p * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  // NOTE: n = -127 (x near -88) would carry into the sign bit; such terms are 0 in float.
  return n < -126.0f ? 0.0f : out;
}

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

// NOTE: bf16 <-> float by bit operations, branch-free: c10::BFloat16's own conversions
// (an isnan branch, calls through its operators) kept `#pragma omp simd` loops scalar, which
// made the bf16 kernels 10-12x slower than the float ones (silu_mul of [32, 2 x 1536]: 250 vs
// 21 us, one thread). Same results bit for bit: round to nearest even, NaN -> 0x7FC0.
template <>
inline float to_float<c10::BFloat16>(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}

template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
}

// 8 floats in a GCC vector; bf16 widened on load (exact: bf16 is the top half of a float).

typedef float v8f __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

inline v8f load8(const c10::BFloat16* p) {
  v8u16 h;
  std::memcpy(&h, p, sizeof(h));
  const v8u32 w = __builtin_convertvector(h, v8u32) << 16;
  v8f v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

inline float hsum8(v8f v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

}  // namespace kvserve
