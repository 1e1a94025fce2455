// Decode attention's AVX-512 kernels (float32 / bfloat16, head_dim % 32 == 0, 1-8 query heads
// per KV head): the scores of 16 key rows reduced together (sum16), the V pass 32 or 64
// columns at a time, bf16 queries straight into vdpbf16ps where the CPU has AVX512_BF16.
// Included by decode_attention.cpp on an AVX-512 build.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../arch/vec_avx512.h"
#include "paged_kv.h"

namespace kvserve {

// AVX-512 path (float32 / bfloat16, d % 32 == 0, 1-8 heads per KV head): 16-float vectors,
// the scores of 16 key rows reduced together instead of one horizontal sum each, and the
// softmax's exponentials 16 at a time.
// NOTE: why. The v8f kernels (decode_portable.h) compile to AVX2 width, and hsum8 costs ~7
// shuffles and adds per score, about as much as the score's FMAs. On the embedded model
// (G = 3, d = 64, bf16, 170 tokens, one thread, K/V in L2) a sequence took 12.4 us with them
// (K pass 5.6, V pass 3.5, softmax and prefetches 3.2) and takes 6.2 us here (2.5, 1.6, 2.1).

// acc + q . k over 32 elements: q float in load32's order for kv_t, k as stored.
template <typename kv_t>
inline __m512 dot32(__m512 acc, const float* q, const kv_t* k) {
  __m512 lo, hi;
  load32(k, lo, hi);
  acc = _mm512_fmadd_ps(_mm512_loadu_ps(q), lo, acc);
  return _mm512_fmadd_ps(_mm512_loadu_ps(q + 16), hi, acc);
}

#if defined(__AVX512BF16__)
// bf16 q and k: vdpbf16ps, acc[i] += q[2i] k[2i] + q[2i+1] k[2i+1] in float. A bf16 product
// is exact in float, so this is the float FMA path in another summation order (inputs and
// results below 2^-126 flush to 0).
// NOTE: vdpbf16ps runs at half the rate of a float FMA here (one per 2 cycles), but saves
// widening K: 5.4 us per sequence of the embedded model, 6.2 with load32 and two FMAs.
// Widening each K row once for all G heads (partial sums through the stack) was slower.
inline __m512 dot32(__m512 acc, const c10::BFloat16* q, const c10::BFloat16* k) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q), (__m512bh)_mm512_loadu_si512(k));
}

template <typename kv_t>
using WideQuery = kv_t;  // bf16 queries go to vdpbf16ps as they are
#else
template <typename kv_t>
using WideQuery = float;
#endif

// scores[g * sstride + r] = scale * q_g . k_r for g < G and r < n, k_r = rows[r] + off;
// rows: 16 pointers, those past the first n repeat an earlier row (their scores are dropped).
// q: [G, d], float in load32's order or bf16 as stored (WideQuery).
// NOTE: head by head, 16 rows at a time: 16 independent accumulators in registers, then one
// sum16. The K rows (16 x d) are read G times, from L1. No branch on n in the loops: with
// one (`if (r < n)`), GCC kept the accumulators on the stack.
template <int G, typename q_t, typename kv_t>
void dot_group16(const q_t* q, const kv_t* const* rows, int64_t off, int64_t n, int64_t d,
                 float scale, float* scores, int64_t sstride, LineStream& lines) {
  const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
  for (int g = 0; g < G; ++g) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 32) {
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) {
        acc[r] = dot32(acc[r], q + g * d + i, rows[r] + off + i);
        if (r % 8 == 7) lines.pump(kPumpLines);
      }
    }
    const __m512 s = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(scores + g * sstride, mask, s);
  }
}

// acc[g] += sum_r p[g * pstride + r] * v_r for g < G, n rows v_r = v + r * stride.
// acc: [G, d] float in load32's order; d % (32 C) == 0.
// NOTE: 32 C columns per pass over the rows (C = 2 reads a d = 64 row's 128 bytes in one
// pass, C = 1 half of it in each of two), with 2 C G accumulators, doubled (even and odd
// rows) when there are 8 or fewer, to have enough independent FMA chains.
template <int G, int C, typename kv_t>
void axpy_group16(const float* p, int64_t pstride, const kv_t* v, int64_t stride, int64_t n,
                  int64_t d, float* acc, LineStream& lines) {
  constexpr int K = 2 * C;  // float vectors per pass and head
  constexpr int S = K * G <= 8 ? 2 : 1;
  for (int64_t i = 0; i < d; i += 32 * C) {
    __m512 a[S][G][K];
    for (int g = 0; g < G; ++g) {
      for (int k = 0; k < K; ++k) {
        a[0][g][k] = _mm512_loadu_ps(acc + g * d + i + 16 * k);
        for (int s = 1; s < S; ++s) a[s][g][k] = _mm512_setzero_ps();
      }
    }
    auto row = [&](int s, int64_t r) {
      __m512 x[K];
      for (int c = 0; c < C; ++c) load32(v + r * stride + i + 32 * c, x[2 * c], x[2 * c + 1]);
      for (int g = 0; g < G; ++g) {
        const __m512 pg = _mm512_set1_ps(p[g * pstride + r]);
        for (int k = 0; k < K; ++k) a[s][g][k] = _mm512_fmadd_ps(pg, x[k], a[s][g][k]);
      }
    };
    int64_t r = 0;
    for (; r + S <= n; r += S) {
      lines.pump(kPumpLines);
      for (int s = 0; s < S; ++s) row(s, r + s);
    }
    for (; r < n; ++r) row(0, r);
    for (int g = 0; g < G; ++g) {
      for (int k = 0; k < K; ++k) {
        for (int s = 1; s < S; ++s) a[0][g][k] = _mm512_add_ps(a[0][g][k], a[s][g][k]);
        _mm512_storeu_ps(acc + g * d + i + 16 * k, a[0][g][k]);
      }
    }
  }
}

template <typename kv_t>
using WideKernels = AttnKernels<WideQuery<kv_t>, kv_t>;

// The AVX-512 kernels for `group` query heads per KV head (nullptr: none).
template <typename kv_t>
inline const WideKernels<kv_t>* wide_kernels(int64_t group, int64_t d) {
  using q_t = WideQuery<kv_t>;
  static const WideKernels<kv_t> table[] = {
      {dot_group16<1, q_t, kv_t>, axpy_group16<1, 1, kv_t>},
      {dot_group16<2, q_t, kv_t>, axpy_group16<2, 1, kv_t>},
      {dot_group16<3, q_t, kv_t>, axpy_group16<3, 1, kv_t>},
      {dot_group16<4, q_t, kv_t>, axpy_group16<4, 1, kv_t>},
      {dot_group16<5, q_t, kv_t>, axpy_group16<5, 1, kv_t>},
      {dot_group16<6, q_t, kv_t>, axpy_group16<6, 1, kv_t>},
      {dot_group16<7, q_t, kv_t>, axpy_group16<7, 1, kv_t>},
      {dot_group16<8, q_t, kv_t>, axpy_group16<8, 1, kv_t>},
  };
  // d % 64 == 0: the V pass takes 64 columns at a time for groups of up to 4 heads.
  static const WideKernels<kv_t> table64[] = {
      {dot_group16<1, q_t, kv_t>, axpy_group16<1, 2, kv_t>},
      {dot_group16<2, q_t, kv_t>, axpy_group16<2, 2, kv_t>},
      {dot_group16<3, q_t, kv_t>, axpy_group16<3, 2, kv_t>},
      {dot_group16<4, q_t, kv_t>, axpy_group16<4, 2, kv_t>},
  };
  if (group < 1 || group > 8 || d % 32 != 0) return nullptr;
  return group <= 4 && d % 64 == 0 ? &table64[group - 1] : &table[group - 1];
}

// Rows the K pass scores at a time (dot_group16).
constexpr int64_t kWideRows = 16;

// n query elements (n % 32 == 0) as float in load32's order, for dot32.
template <typename scalar_t>
inline void wide_queries(const scalar_t* q, float* qf, int64_t n) {
  for (int64_t i = 0; i < n; i += 32) {
    __m512 lo, hi;
    load32(q + i, lo, hi);
    _mm512_storeu_ps(qf + i, lo);
    _mm512_storeu_ps(qf + i + 16, hi);
  }
}

// acc [n] float in load32's order -> out [n] in element order, rounded to scalar_t.
template <typename scalar_t>
inline void wide_store(const float* acc, scalar_t* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 32) {
    float chunk[32];
    unsplit32<scalar_t>(acc + i, chunk);
    for (int e = 0; e < 32; ++e) out[i + e] = from_float<scalar_t>(chunk[e]);
  }
}

// The softmax's vector width (attention/softmax.h).
using WideVec = Vec16;

}  // namespace kvserve
