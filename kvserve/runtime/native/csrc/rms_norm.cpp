// add_rms_norm: hidden += residual; out = rms_norm(hidden) * weight, row by row (portable
// rows, and 16-lane rows on AVX-512 BW/VL). Numerics (the double sum of squares): README.md.
#include <cmath>
#include <optional>
#include <type_traits>

#include "common.h"
#include "ops.h"

namespace kvserve {

namespace {

// One row of add_rms_norm: h += r (if r), o = (h * rsqrt(mean(h^2) + eps)) * w.
// NOTE: the loops live outside AT_DISPATCH's macro argument, where a #pragma cannot go.
template <typename scalar_t>
void rms_row(scalar_t* h, const scalar_t* r, const scalar_t* w, scalar_t* o, int64_t n,
             float eps) {
  // NOTE: the sum of squares in double: the float mean then carries one rounding, where
  // float sums in any lane order (torch's or ours) carry several. This scale multiplies
  // every element of the row and the error grows through the layers: on a 140-token prompt
  // of the embedded model a float sum put the logits 4.8e-3 from a float64 run, this
  // 9.7e-4 (transformers in float32: 7.1e-4; kvserve's torch ops: 1.8e-4).
  // NOTE: the add and the sum of squares in two loops: one loop mixing 16-bit stores with a
  // double reduction stayed scalar for bf16 (35 us vs 8 us for a [32, 576] add + norm).
  if (r != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) h[i] = from_float<scalar_t>(to_float(h[i]) + to_float(r[i]));
  }
  double sumsq = 0.0;
#pragma omp simd reduction(+ : sumsq)
  for (int64_t i = 0; i < n; ++i) sumsq += static_cast<double>(to_float(h[i])) * to_float(h[i]);
  const float mean = static_cast<float>(sumsq / static_cast<double>(n));
  const float scale = 1.0f / std::sqrt(mean + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    o[i] = from_float<scalar_t>((to_float(h[i]) * scale) * to_float(w[i]));
  }
}

#if defined(KVSERVE_WIDE_SILU)

// rms_row on 16 lanes: the same operations (the add rounded once, squares summed in double,
// the scale applied as (h * scale) * w), so the same results (bf16 NaN and denormal bits
// aside, see bf16_words16): the double sum of a row's squares is exact for bf16 rows in any
// order, and for float rows its order changes it by ~1e-16, below the float mean's rounding.
// The tail runs masked (zeros add nothing).
// NOTE: why. GCC's `omp simd` loops kept one double accumulator (a 4-cycle FMA chain) and
// rounded with six integer instructions per 16 values: a [32, 576] bf16 call took 11.3-12.2 us
// from Python, one thread, and takes 8.2-8.6 with four accumulators and vcvtneps2bf16 (the AMX
// Xeon, 2026-12-05, eb3e34e; git show 25ace60:bench/results/session23/layer_ops_probe_ab.txt).
template <typename scalar_t>
void rms_row_wide(scalar_t* h, const scalar_t* r, const scalar_t* w, scalar_t* o, int64_t n,
                  float eps) {
  __m512d acc[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(),
                    _mm512_setzero_pd()};
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask16(n - i);
    __m512 x = load16(h + i, m);
    if (r != nullptr) {
      x = round16<scalar_t>(_mm512_add_ps(x, load16(r + i, m)));
      store16(h + i, m, x);  // x is already at scalar_t's precision: stored exactly
    }
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1));
    const int a = (i / 16) % 2 * 2;
    acc[a] = _mm512_fmadd_pd(lo, lo, acc[a]);
    acc[a + 1] = _mm512_fmadd_pd(hi, hi, acc[a + 1]);
  }
  const double sumsq = _mm512_reduce_add_pd(
      _mm512_add_pd(_mm512_add_pd(acc[0], acc[1]), _mm512_add_pd(acc[2], acc[3])));
  const float mean = static_cast<float>(sumsq / static_cast<double>(n));
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask16(n - i);
    store16(o + i, m, _mm512_mul_ps(_mm512_mul_ps(load16(h + i, m), scale), load16(w + i, m)));
  }
}

#endif  // KVSERVE_WIDE_SILU

}  // namespace

// hidden += residual (if given); out = rms_norm(hidden) * weight, row by row. out may be
// residual itself: a row's residual is read before its output is written.
void add_rms_norm(Tensor hidden, const std::optional<Tensor>& residual, Tensor weight,
                  double eps, Tensor out) {
  check_rows(hidden, "hidden");
  check_rows(out, "out");
  check_cpu(weight, "weight");
  const int64_t rows = hidden.size(0), n = hidden.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n, "weight must have ", n,
              " contiguous elements");
  TORCH_CHECK(out.sizes() == hidden.sizes(), "out must match hidden's shape");
  TORCH_CHECK(out.scalar_type() == hidden.scalar_type() &&
                  weight.scalar_type() == hidden.scalar_type(),
              "hidden, weight and out must share a dtype");
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == hidden.sizes() &&
                    residual->scalar_type() == hidden.scalar_type(),
                "residual must match hidden's shape and dtype");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, hidden.scalar_type(), "add_rms_norm",
                                  [&] {
    scalar_t* h = hidden.data_ptr<scalar_t>();
    const scalar_t* res = residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr;
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t hs = hidden.stride(0), rs = res ? residual->stride(0) : 0, os = out.stride(0);
    at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
#if defined(KVSERVE_WIDE_SILU)
      if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
        for (int64_t t = begin; t < end; ++t) {
          rms_row_wide<scalar_t>(h + t * hs, res ? res + t * rs : nullptr, w, o + t * os, n,
                                 static_cast<float>(eps));
        }
        return;
      }
#endif
      for (int64_t t = begin; t < end; ++t) {
        rms_row<scalar_t>(h + t * hs, res ? res + t * rs : nullptr, w, o + t * os, n,
                          static_cast<float>(eps));
      }
    });
  });
}

}  // namespace kvserve
