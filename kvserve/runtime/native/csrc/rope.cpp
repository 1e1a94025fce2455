// rope_: rotate-half RoPE in place on the query and key heads of the fused qkv buffer.
#include "common.h"
#include "ops.h"

namespace kvserve {

namespace {

// One token of rope_: heads rows of d, cos/sin rows c/s of d.
template <typename scalar_t>
void rope_row(scalar_t* x, const scalar_t* c, const scalar_t* s, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t hd = 0; hd < heads; ++hd) {
    scalar_t* lo = x + hd * d;
    scalar_t* hi = lo + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float xl = to_float(lo[i]), xh = to_float(hi[i]);
      lo[i] = from_float<scalar_t>(xl * to_float(c[i]) + xh * to_float(s[i]));
      hi[i] = from_float<scalar_t>(xh * to_float(c[half + i]) + xl * to_float(s[half + i]));
    }
  }
}

}  // namespace

// Rotate-half RoPE in place on x [T, heads, d] (rows may be strided; heads contiguous).
// cos, sin: [T, 1, d] contiguous, sin's first half negated (see rope_cos_sin in models/rope.py).
void rope_(Tensor x, Tensor cos, Tensor sin) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x must be [T, heads, d] with contiguous heads, got strides ", x.strides());
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == rows * d &&
                  sin.numel() == rows * d,
              "cos and sin must be contiguous [T, 1, d]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos and sin must have x's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rope_", [&] {
    scalar_t* base = x.data_ptr<scalar_t>();
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0);
    at::parallel_for(0, rows, grain_for(heads * d), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        rope_row<scalar_t>(base + t * xs, c + t * d, s + t * d, heads, d);
      }
    });
  });
}

}  // namespace kvserve
