// argmax_rows: greedy sampling's per-row argmax (torch.max(dim).indices: the first maximum,
// a NaN maximal), with the rows' finite flags from the same pass.
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>

#include "common.h"
#include "ops.h"

namespace kvserve {

namespace {

// First index of the row's maximum, a NaN counting as maximal (torch.max(dim).indices).
// NOTE: two passes: a vectorized max (and NaN check) over the row, then a scan for its first
// occurrence. ATen's max-with-indices keeps an index per lane and ran at ~1.2 G elements/s
// on [32, 49152] logits (1.3 ms, one thread), 20x slower than its plain amax.
// ``finite``: set to whether every element of the row is finite.
template <typename scalar_t>
int64_t argmax_row(const scalar_t* x, int64_t n, bool& finite) {
  float m = -std::numeric_limits<float>::infinity();
  int nan = 0, special = 0;
#pragma omp simd reduction(max : m) reduction(| : nan, special)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    nan |= v != v;
    special |= !(std::fabs(v) <= std::numeric_limits<float>::max());  // NaN or +-inf
    m = std::max(m, v);
  }
  finite = special == 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    if (nan ? v != v : v == m) return i;
  }
  return 0;  // n == 0 is rejected by the caller
}

#if defined(KVSERVE_WIDE_ARGMAX)

// argmax_row in one pass over 16 lanes: lane j keeps the largest value among elements
// j, j + 16, ... and its first index (a later equal value does not replace it); the row's
// answer is the smallest index among the lanes holding the largest value. A NaN ends the
// scan: the first one is the answer. ``finite``: as argmax_row's.
// NOTE: why. The two-pass version's second pass (the first occurrence of the maximum) ran
// scalar: greedy decoding's [32, 49152] bf16 logits took 0.47 ms on two threads, warm.
template <typename scalar_t>
int64_t argmax_row_wide(const scalar_t* x, int64_t n, bool& finite) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 best = _mm512_set1_ps(-kInf);  // masked tail lanes read as -inf too
  __m512i at = lane;  // index of `best` per lane
  __mmask16 special = 0;  // lanes that held +-inf (a NaN returns at once)
  finite = false;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask16(n - i);
    const __m512 v = _mm512_mask_blend_ps(m, _mm512_set1_ps(-kInf), load16(x + i, m));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (nan != 0) return i + __builtin_ctz(nan);
    special |= _mm512_mask_fpclass_ps_mask(m, v, 0x18);  // +inf (0x08) or -inf (0x10)
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    at = _mm512_mask_mov_epi32(at, gt, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(i))));
  }
  finite = special == 0;
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 hold = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(hold, at);
}
#endif

}  // namespace

// out [N] int64 = per-row argmax of logits [N, V] (rows contiguous); finite [N] bool (if
// given) = whether each row is free of NaN and infinities, found in the same pass.
// NOTE: why in the same pass: the sampling guard's own check (a sum over the logits) read the
// [32, 49152] bf16 rows again, cold from the lm_head's writes: ~0.3 ms of a ~20 ms step.
void argmax_rows(Tensor out, Tensor logits, const std::optional<Tensor>& finite) {
  check_rows(logits, "logits");
  check_cpu(out, "out");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n > 0, "logits must have at least one column");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == rows,
              "out must be a contiguous int64 tensor of ", rows, " elements");
  if (finite.has_value()) {
    check_cpu(*finite, "finite");
    TORCH_CHECK(finite->scalar_type() == at::kBool && finite->is_contiguous() &&
                    finite->numel() == rows,
                "finite must be a contiguous bool tensor of ", rows, " elements");
  }
  int64_t* o = out.data_ptr<int64_t>();
  bool* fin = finite.has_value() ? finite->data_ptr<bool>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "argmax_rows",
                                  [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    const int64_t xs = logits.stride(0);
    at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
#if defined(KVSERVE_WIDE_ARGMAX)
      if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
        for (int64_t r = begin; r < end; ++r) {
          bool ok = false;
          o[r] = argmax_row_wide<scalar_t>(x + r * xs, n, ok);
          if (fin != nullptr) fin[r] = ok;
        }
        return;
      }
#endif
      for (int64_t r = begin; r < end; ++r) {
        bool ok = false;
        o[r] = argmax_row<scalar_t>(x + r * xs, n, ok);
        if (fin != nullptr) fin[r] = ok;
      }
    });
  });
}

}  // namespace kvserve
