// AVX2 + FMA vector primitives (8 floats): load/store with bf16 widening and rounding, exp8
// (exp_approx's operations in its order), the 8-way horizontal sum, tail masks, and Vec8, the
// traits the width-generic kernels (attention/softmax.h) take. Included through arch/vec.h.
#pragma once

#include <immintrin.h>

#include "vec_scalar.h"

namespace kvserve {

inline __m256 load8f(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8f(const c10::BFloat16* p) {  // exact, like to_float
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// Lane i of the result: the sum of v[i]'s 8 lanes (6 vhaddps, 2 vperm2f128, 1 add).
inline __m256 sum8(const __m256* v) {
  // t: pair sums of two vectors per 128-bit lane; u: their quad sums, v[0..3] low / high half.
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// exp_approx on 8 lanes, its operations in its order (p * 2^n by the exponent-bits add).
// NOTE: no n < -126 select: after the clamp n >= -126 (exp16's note).
inline __m256 exp8(__m256 x) {
  // max(lo, x) and min(hi, x) return x when x is NaN, like std::max(x, lo) and std::min.
  x = _mm256_min_ps(_mm256_set1_ps(kExpMax), _mm256_max_ps(_mm256_set1_ps(kExpMin), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

// The lanes of an 8-wide step with `left` elements left: all 8, or the first `left`.
inline __m256i tail_mask8(int64_t left) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(left, 8))),
                            lane);
}

// 8 floats -> 8 bf16 words rounded as from_float rounds (nearest even, NaN -> 0x7FC0).
inline __m128i bf16_words8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb);
  __m256i words = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  words = _mm256_blendv_epi8(words, _mm256_set1_epi32(0x7FC0), nan);
  // Packed per 128-bit lane: words 0-3 in quadword 0, 4-7 in quadword 2.
  const __m256i packed = _mm256_packus_epi32(words, words);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

inline __m256 round8(__m256 v, float) { return v; }  // to float's precision: itself

inline __m256 round8(__m256 v, c10::BFloat16) {  // to bf16's precision and back
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_words8(v)), 16));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

inline void store8(c10::BFloat16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_words8(v));
}

// The width-generic kernels' view of this instruction set (attention/softmax.h).
struct Vec8 {
  static constexpr int64_t kWidth = 8;
  using Reg = __m256;
  using Mask = __m256i;
  static Reg set1(float x) { return _mm256_set1_ps(x); }
  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static Reg sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
  static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static Reg exp(Reg x) { return exp8(x); }
  static Mask tail_mask(int64_t left) { return tail_mask8(left); }
  static Reg load_tail(const float* p, Mask m) { return _mm256_maskload_ps(p, m); }
  static void store_tail(float* p, Mask m, Reg v) { _mm256_maskstore_ps(p, m, v); }
  static Reg keep_tail(Mask m, Reg v) { return _mm256_and_ps(v, _mm256_castsi256_ps(m)); }
  static float reduce_add(Reg v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    return hsum8(load8(lanes));
  }
};

}  // namespace kvserve
