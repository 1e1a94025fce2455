// AVX-512 vector primitives (16 floats): 32-element loads in the "split" order, exp16
// (exp_approx's results bit for bit), the 16-way horizontal sum, and (with AVX512BW/VL) masked
// loads and stores with bf16 widening and rounding; Vec16, the traits the width-generic
// kernels (attention/softmax.h) take. Included through arch/vec.h.
#pragma once

#include <immintrin.h>

#include <type_traits>

#include "vec_scalar.h"

namespace kvserve {

// 32 elements as two 16-float halves: float32 as they lie ([0, 16) and [16, 32)); bfloat16
// as its even and odd elements, widened by a shift and a mask (exact, like to_float), which
// is cheaper than an in-order widening (a lane-crossing shuffle per 16 elements).
// Accumulators and float queries of this path are kept in that "split" order.
inline void load32(const float* p, __m512& lo, __m512& hi) {
  lo = _mm512_loadu_ps(p);
  hi = _mm512_loadu_ps(p + 16);
}

inline void load32(const c10::BFloat16* p, __m512& lo, __m512& hi) {
  const __m512i x = _mm512_loadu_si512(p);  // bf16 pairs: element 2i low, 2i + 1 high
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// split[32] (load32's order for kv_t) -> out[32] in element order.
template <typename kv_t>
inline void unsplit32(const float* split, float* out) {
  if constexpr (std::is_same_v<kv_t, float>) {
    std::memcpy(out, split, 32 * sizeof(float));
  } else {
    const __m512 even = _mm512_loadu_ps(split), odd = _mm512_loadu_ps(split + 16);
    const __m512i first =
        _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    _mm512_storeu_ps(out, _mm512_permutex2var_ps(even, first, odd));
    _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(even, second, odd));
  }
}

// exp_approx on 16 lanes, the same operations in the same order (GCC contracts the scalar
// code's `a * b + c` into these FMAs), so the same results bit for bit: checked over
// [-100, 100] in steps of 1e-4 and at +-0, +-inf and NaN.
// NOTE: why not `#pragma omp simd` over exp_approx: GCC turns its clamps and final select into
// mask-register juggling (~40 instructions per 8 floats); this is ~20 per 16.
inline __m512 exp16(__m512 x) {
  // max(lo, x) and min(hi, x) return x when x is NaN, like std::max(x, lo) and std::min.
  x = _mm512_min_ps(_mm512_set1_ps(kExpMax), _mm512_max_ps(_mm512_set1_ps(kExpMin), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  // NOTE: p * 2^n in one vscalefps instead of exp_approx's exponent-bits add, its n < -126
  // select and the float -> int conversion (4 of ~20 instructions; silu_mul's [32, 1536] bf16
  // row set 28 -> 26 us, one thread, bench/probes/silu_variants.cpp at 25ace60). Same bits:
  // after the clamp n >= -126 and r > 0 at n = -126, so p * 2^n is a normal float, which the
  // bits add builds exactly too.
  return _mm512_scalef_ps(p, n);
}

// Lane i of the result: the sum of v[i]'s 16 lanes (16 horizontal sums at once, in 15
// shuffles, 15 blends and 15 adds). Each level halves the width: for each pair (a, b) the
// blend keeps a's low and b's high part and the shuffle brings a's high and b's low part,
// so the sum holds a's partial sums in its low and b's in its high parts.
inline __m512 sum16(const __m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i) {  // 256-bit halves: x[i] = [v[i] | v[i + 8]]
    const __m512 a = v[i], b = v[i + 8];
    x[i] = _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, a, b),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 3, 2)));
  }
  const __m512i swap128 =
      _mm512_setr_epi32(4, 5, 6, 7, 16, 17, 18, 19, 12, 13, 14, 15, 24, 25, 26, 27);
  for (int i = 0; i < 4; ++i) {  // 128-bit quarters
    const __m512 a = x[i], b = x[i + 4];
    y[i] = _mm512_add_ps(_mm512_mask_blend_ps(0xF0F0, a, b),
                         _mm512_permutex2var_ps(a, swap128, b));
  }
  for (int i = 0; i < 2; ++i) {  // 64-bit pairs
    const __m512d a = _mm512_castps_pd(y[i]), b = _mm512_castps_pd(y[i + 2]);
    z[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_mask_blend_pd(0xAA, a, b)),
                         _mm512_castpd_ps(_mm512_shuffle_pd(a, b, 0x55)));
  }
  const __m512i swap32 =
      _mm512_setr_epi32(1, 16, 3, 18, 5, 20, 7, 22, 9, 24, 11, 26, 13, 28, 15, 30);
  return _mm512_add_ps(_mm512_mask_blend_ps(0xAAAA, z[0], z[1]),
                       _mm512_permutex2var_ps(z[0], swap32, z[1]));
}

// The width-generic kernels' view of this instruction set (attention/softmax.h).
struct Vec16 {
  static constexpr int64_t kWidth = 16;
  using Reg = __m512;
  using Mask = __mmask16;
  static Reg set1(float x) { return _mm512_set1_ps(x); }
  static Reg zero() { return _mm512_setzero_ps(); }
  static Reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static Reg sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
  static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static Reg exp(Reg x) { return exp16(x); }
  static Mask tail_mask(int64_t left) { return static_cast<__mmask16>((1u << left) - 1); }
  static Reg load_tail(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
  static void store_tail(float* p, Mask m, Reg v) { _mm512_mask_storeu_ps(p, m, v); }
  static Reg keep_tail(Mask m, Reg v) { return _mm512_maskz_mov_ps(m, v); }
  static float reduce_add(Reg v) { return _mm512_reduce_add_ps(v); }
};

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// The lanes of a 16-wide step with `left` elements left in the row: all 16, or the first `left`.

inline __mmask16 tail_mask16(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

template <typename scalar_t>
inline __m512 load16(const scalar_t* p, __mmask16 m);

template <>
inline __m512 load16<float>(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}

template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p, __mmask16 m) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));  // exact, like to_float
}

// from_float<bfloat16> on 16 lanes: round to nearest even, NaN -> 0x7FC0.
inline __m512i bf16_bits16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb);
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC0));
}

template <typename scalar_t>
inline __m512 round16(__m512 v);  // to scalar_t's precision and back

template <>
inline __m512 round16<float>(__m512 v) {
  return v;
}

// NOTE: with AVX512_BF16, vcvtneps2bf16 rounds to nearest even in one instruction where
// bf16_bits16 takes six (silu_mul's [32, 1536] bf16 rows 35 -> 28 us, one thread,
// bench/probes/silu_variants.cpp at 25ace60). Same bits
// but for NaN (a quiet NaN keeping its sign, not 0x7FC0) and denormals (flushed to zero:
// the instruction ignores MXCSR), which no activation of a real model reaches.
#if defined(__AVX512BF16__)
inline __m256i bf16_words16(__m512 v) {
  return (__m256i)_mm512_cvtneps_pbh(v);
}
#else
inline __m256i bf16_words16(__m512 v) {
  return _mm512_cvtepi32_epi16(bf16_bits16(v));
}
#endif

template <>
inline __m512 round16<c10::BFloat16>(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_words16(v)), 16));
}

template <typename scalar_t>
inline void store16(scalar_t* p, __mmask16 m, __m512 v);

template <>
inline void store16<float>(float* p, __mmask16 m, __m512 v) {
  _mm512_mask_storeu_ps(p, m, v);
}

template <>
inline void store16<c10::BFloat16>(c10::BFloat16* p, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(p, m, bf16_words16(v));
}

#endif  // __AVX512BW__ && __AVX512VL__

}  // namespace kvserve
