// Decode attention's AVX2 kernels (float32 / bfloat16, head_dim % 8 == 0, 1-8 query heads per
// KV head; the AVX2-only CPUs): decode_avx512.h's passes at half the width. Included by
// decode_attention.cpp on an AVX2 build without AVX-512.
#pragma once

#include <cstdint>

#include "../arch/vec_avx2.h"

#include "paged_kv.h"

namespace kvserve {

// AVX2 path (float32 / bfloat16, d % 8 == 0, 1-8 heads per KV head; the AVX2-only CPUs, such
// as Zen 3): decode_seq_wide's passes on 8-float vectors. The scores of 8 key rows are
// reduced together (sum8) instead of one horizontal sum each (hsum8 of the portable kernels,
// ~7 operations a score, as many as the score's FMAs at d = 64), the softmax's exponentials
// 8 at a time (exp8), and the reads streamed as on AVX-512 (LineStream). Queries and
// accumulators stay in element order: bf16 widens in order with one vpmovzxwd.

// Rows the K pass scores at a time (dot_group8).
constexpr int64_t kWideRows = 8;

template <typename kv_t>
using WideQuery = float;

// scores[g * sstride + r] = scale * q_g . k_r for g < G and r < n, k_r = rows[r] + off;
// rows: 8 pointers, those past the first n repeat an earlier row (their scores are dropped).
// q: [G, d] float. NOTE: dot_group16's shape at half the width: head by head, 8 rows at a
// time, 8 accumulators, then one sum8.
template <int G, typename kv_t>
void dot_group8(const float* q, const kv_t* const* rows, int64_t off, int64_t n, int64_t d,
                float scale, float* scores, int64_t sstride, LineStream& lines) {
  const __m256i mask = tail_mask8(n);
  for (int g = 0; g < G; ++g) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + g * d + i);
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(qv, load8f(rows[r] + off + i), acc[r]);
      if (i % 16 == 8) lines.pump(kPumpLines);
    }
    const __m256 s = _mm256_mul_ps(sum8(acc), _mm256_set1_ps(scale));
    _mm256_maskstore_ps(scores + g * sstride, mask, s);
  }
}

// acc[g] += sum_r p[g * pstride + r] * v_r for g < G, n rows v_r = v + r * stride.
// acc: [G, d] float; d % (8 K) == 0. NOTE: 8 K columns per pass over the rows with K G
// accumulators, doubled (even and odd rows) while they fit 12 of the 16 ymm registers.
template <int G, int K, typename kv_t>
void axpy_group8(const float* p, int64_t pstride, const kv_t* v, int64_t stride, int64_t n,
                 int64_t d, float* acc, LineStream& lines) {
  constexpr int S = 2 * K * G <= 12 ? 2 : 1;
  for (int64_t i = 0; i < d; i += 8 * K) {
    __m256 a[S][G][K];
    for (int g = 0; g < G; ++g) {
      for (int k = 0; k < K; ++k) {
        a[0][g][k] = _mm256_loadu_ps(acc + g * d + i + 8 * k);
        for (int s = 1; s < S; ++s) a[s][g][k] = _mm256_setzero_ps();
      }
    }
    auto row = [&](int s, int64_t r) {
      __m256 x[K];
      for (int k = 0; k < K; ++k) x[k] = load8f(v + r * stride + i + 8 * k);
      for (int g = 0; g < G; ++g) {
        const __m256 pg = _mm256_broadcast_ss(p + g * pstride + r);
        for (int k = 0; k < K; ++k) a[s][g][k] = _mm256_fmadd_ps(pg, x[k], a[s][g][k]);
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
        for (int s = 1; s < S; ++s) a[0][g][k] = _mm256_add_ps(a[0][g][k], a[s][g][k]);
        _mm256_storeu_ps(acc + g * d + i + 8 * k, a[0][g][k]);
      }
    }
  }
}

template <typename kv_t>
using WideKernels = AttnKernels<float, kv_t>;

// The AVX2 kernels for `group` query heads per KV head (nullptr: none).
template <typename kv_t>
inline const WideKernels<kv_t>* wide_kernels(int64_t group, int64_t d) {
  static const WideKernels<kv_t> table[] = {
      {dot_group8<1, kv_t>, axpy_group8<1, 1, kv_t>},
      {dot_group8<2, kv_t>, axpy_group8<2, 1, kv_t>},
      {dot_group8<3, kv_t>, axpy_group8<3, 1, kv_t>},
      {dot_group8<4, kv_t>, axpy_group8<4, 1, kv_t>},
      {dot_group8<5, kv_t>, axpy_group8<5, 1, kv_t>},
      {dot_group8<6, kv_t>, axpy_group8<6, 1, kv_t>},
      {dot_group8<7, kv_t>, axpy_group8<7, 1, kv_t>},
      {dot_group8<8, kv_t>, axpy_group8<8, 1, kv_t>},
  };
  // d % 16 == 0: the V pass takes 16 columns at a time for groups of up to 3 heads.
  static const WideKernels<kv_t> table16[] = {
      {dot_group8<1, kv_t>, axpy_group8<1, 2, kv_t>},
      {dot_group8<2, kv_t>, axpy_group8<2, 2, kv_t>},
      {dot_group8<3, kv_t>, axpy_group8<3, 2, kv_t>},
  };
  if (group < 1 || group > 8 || d % 8 != 0) return nullptr;
  return group <= 3 && d % 16 == 0 ? &table16[group - 1] : &table[group - 1];
}

template <typename scalar_t>
inline void wide_queries(const scalar_t* q, float* qf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) qf[i] = to_float(q[i]);
}

template <typename scalar_t>
inline void wide_store(const float* acc, scalar_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = from_float<scalar_t>(acc[i]);
}

// The softmax's vector width (attention/softmax.h).
using WideVec = Vec8;

}  // namespace kvserve
