// Softmax of decode attention's score rows in place: the portable rows (exp_approx under
// `#pragma omp simd`) and softmax_rows_wide, one width-generic loop over the instruction
// set's exponential (V: Vec16 on AVX-512, Vec8 on AVX2; arch/vec_*.h).
#pragma once

#include <cstdint>
#include <limits>

#include "../arch/vec.h"

namespace kvserve {

// The largest of n scores.
// NOTE: a max in any lane order is the same max. Written with std::max (and without the
// pragma) this loop stayed scalar, one dependent vmaxss per score: ~1.6 us per sequence of
// the embedded model (9 heads x 170 scores), as much as its AVX-512 V pass.
inline float row_max(const float* sq, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t t = 0; t < n; ++t) m = sq[t] > m ? sq[t] : m;
  return m;
}

// sq[t] /= sum for n exponentials.
// NOTE: normalize the probabilities, not the output: the same rounding as softmax.
inline void normalize_row(float* sq, int64_t n, float sum) {
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) sq[t] *= inv;
}

// Softmax of each of the nq rows of scores [nq, n] in place (float, max-subtracted).
inline void softmax_rows(float* scores, int64_t nq, int64_t n) {
  for (int64_t iq = 0; iq < nq; ++iq) {
    float* sq = scores + iq * n;
    const float m = row_max(sq, n);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      const float e = exp_approx(sq[t] - m);
      sq[t] = e;
      sum += e;
    }
    normalize_row(sq, n, sum);
  }
}

#if defined(KVSERVE_WIDE_ATTN)
// softmax_rows with V's exponential: the exponentials summed in V::kWidth lanes (the
// compiler's `omp simd` sum keeps 8), the row's tail masked, the lanes summed once.
template <typename V>
inline void softmax_rows_wide(float* scores, int64_t nq, int64_t n) {
  const int64_t full = n - n % V::kWidth;
  const typename V::Mask tail = V::tail_mask(n % V::kWidth);
  for (int64_t iq = 0; iq < nq; ++iq) {
    float* sq = scores + iq * n;
    const typename V::Reg mv = V::set1(row_max(sq, n));
    typename V::Reg sum = V::zero();
    for (int64_t t = 0; t < full; t += V::kWidth) {
      const typename V::Reg e = V::exp(V::sub(V::load(sq + t), mv));
      V::store(sq + t, e);
      sum = V::add(sum, e);
    }
    if (full < n) {
      const typename V::Reg e = V::exp(V::sub(V::load_tail(sq + full, tail), mv));
      V::store_tail(sq + full, tail, e);
      sum = V::add(sum, V::keep_tail(tail, e));
    }
    normalize_row(sq, n, V::reduce_add(sum));
  }
}
#endif  // KVSERVE_WIDE_ATTN

}  // namespace kvserve
