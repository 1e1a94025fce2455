// silu_mul: out = silu(gate) * up over the fused gate_up buffer: a portable row, an 8-lane
// AVX2 row and a masked 16-lane AVX-512 row, all bit for bit the same (README.md).
#include <cstring>
#include <type_traits>

#include "common.h"
#include "ops.h"

namespace kvserve {

namespace {

// One row of silu_mul: o[i] = silu(gu[i]) * gu[inter + i], silu rounded like torch's.
template <typename scalar_t>
void silu_mul_row(const scalar_t* gu, scalar_t* o, int64_t inter) {
  const scalar_t* u = gu + inter;
#pragma omp simd
  for (int64_t i = 0; i < inter; ++i) {
    const float x = to_float(gu[i]);
    const float silu = to_float(from_float<scalar_t>(x / (1.0f + exp_approx(-x))));
    o[i] = from_float<scalar_t>(silu * to_float(u[i]));
  }
}

#if defined(KVSERVE_WIDE_SILU)

// silu_mul_row on 16 lanes with exp16, the same operations as the scalar row (float and
// bfloat16), so the same results bit for bit; the row's tail runs masked, so a result does
// not depend on where in a row an element lies.
// NOTE: why. `#pragma omp simd` over the scalar row ran at ~1 G elements/s a thread (the
// clamps and selects of exp_approx, see exp16), slower than torch's two passes (F.silu,
// then a multiply): [512, 1536] took 392 us on 2 threads, torch 327.

template <typename scalar_t>
void silu_mul_row_wide(const scalar_t* gu, scalar_t* o, int64_t inter) {
  const scalar_t* u = gu + inter;
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < inter; i += 16) {
    const __mmask16 m = tail_mask16(inter - i);
    const __m512 x = load16(gu + i, m);
    const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign));
    const __m512 silu = round16<scalar_t>(_mm512_div_ps(x, _mm512_add_ps(one, exp16(neg))));
    store16(o + i, m, _mm512_mul_ps(silu, load16(u + i, m)));
  }
}

// rms_row on 16 lanes: the same operations (the add rounded once, squares summed in double,

#elif defined(KVSERVE_AVX2_SILU)

// silu_mul_row on 8 lanes with exp8: the scalar row's operations in its order, so the same
// results bit for bit. The row's tail runs through the same code on a zero-padded copy.
// NOTE: why. The scalar row's `omp simd` loop took [32, 1536] in 176-178 us (fp32) and 328-343
// (bf16) on one thread of an x86-64-v3 build, 26 and 70 here (the AMX Xeon, 2026-12-05,
// 4560dbc; git show 25ace60:bench/results/session24/layer_ops_avx2_ab.txt): ~3 ms of a fp32
// B=32 step of the embedded model on two threads, ~7 % of a 512-token prefill chunk (~0.68 s
// there).

template <typename scalar_t>
void silu_mul_row_wide(const scalar_t* gu, scalar_t* o, int64_t inter) {
  const scalar_t* u = gu + inter;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 one = _mm256_set1_ps(1.0f);
  auto step = [&](const scalar_t* g8, const scalar_t* u8, scalar_t* o8) {
    const __m256 x = load8f(g8);
    const __m256 e = exp8(_mm256_xor_ps(x, sign));
    const __m256 silu = round8(_mm256_div_ps(x, _mm256_add_ps(one, e)), scalar_t{});
    store8(o8, _mm256_mul_ps(silu, load8f(u8)));
  };
  int64_t i = 0;
  for (; i + 8 <= inter; i += 8) step(gu + i, u + i, o + i);
  if (i < inter) {
    const size_t left = static_cast<size_t>(inter - i) * sizeof(scalar_t);
    scalar_t g8[8], u8[8], o8[8];
    std::memset(g8, 0, sizeof(g8));
    std::memset(u8, 0, sizeof(u8));
    std::memcpy(g8, gu + i, left);
    std::memcpy(u8, u + i, left);
    step(g8, u8, o8);
    std::memcpy(o + i, o8, left);
  }
}

#endif

}  // namespace

// out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]
void silu_mul(Tensor out, Tensor gate_up) {
  check_rows(out, "out");
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), inter = out.size(1);
  TORCH_CHECK(gate_up.size(1) == 2 * inter && out.size(0) == rows,
              "gate_up must be [T, 2 I] for out [T, I]");
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type(), "out and gate_up must share a dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "silu_mul", [&] {
    const scalar_t* gu = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t gs = gate_up.stride(0), os = out.stride(0);
    at::parallel_for(0, rows, grain_for(inter), [&](int64_t begin, int64_t end) {
#if defined(KVSERVE_WIDE_SILU) || defined(KVSERVE_AVX2_SILU)
      if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
        for (int64_t t = begin; t < end; ++t) {
          silu_mul_row_wide<scalar_t>(gu + t * gs, o + t * os, inter);
        }
        return;
      }
#endif
      for (int64_t t = begin; t < end; ++t) silu_mul_row<scalar_t>(gu + t * gs, o + t * os, inter);
    });
  });
}

}  // namespace kvserve
