// Decode attention's portable kernels: one query head against key/value rows (dot_rows,
// axpy_rows, any dtype and head_dim) and the grouped kernels in v8f GCC vectors (dot_group,
// axpy_group: float32 / bfloat16, head_dim % 8 == 0, 1-8 query heads per KV head). The
// kernels of a build without AVX2 or AVX-512, and of shapes the wide kernels do not take.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../arch/vec_scalar.h"

namespace kvserve {

template <typename scalar_t>
inline void dot_rows(const float* q, const scalar_t* k, int64_t stride, int64_t n, int64_t d,
                     float* scores) {
  int64_t r = 0;
  for (; r + 4 <= n; r += 4) {
    const scalar_t* k0 = k + r * stride;
    const scalar_t* k1 = k0 + stride;
    const scalar_t* k2 = k1 + stride;
    const scalar_t* k3 = k2 + stride;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t i = 0; i < d; ++i) {
      s0 += q[i] * to_float(k0[i]);
      s1 += q[i] * to_float(k1[i]);
      s2 += q[i] * to_float(k2[i]);
      s3 += q[i] * to_float(k3[i]);
    }
    scores[r] = s0;
    scores[r + 1] = s1;
    scores[r + 2] = s2;
    scores[r + 3] = s3;
  }
  for (; r < n; ++r) {
    const scalar_t* kr = k + r * stride;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < d; ++i) s += q[i] * to_float(kr[i]);
    scores[r] = s;
  }
}

// acc += sum_r p[r] * v_r for n value rows v_r = v + r * stride (d floats each).
template <typename scalar_t>
inline void axpy_rows(const float* p, const scalar_t* v, int64_t stride, int64_t n, int64_t d,
                      float* acc) {
  int64_t r = 0;
  for (; r + 4 <= n; r += 4) {
    const scalar_t* v0 = v + r * stride;
    const scalar_t* v1 = v0 + stride;
    const scalar_t* v2 = v1 + stride;
    const scalar_t* v3 = v2 + stride;
    const float p0 = p[r], p1 = p[r + 1], p2 = p[r + 2], p3 = p[r + 3];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) {
      acc[i] += (p0 * to_float(v0[i]) + p1 * to_float(v1[i])) +
                (p2 * to_float(v2[i]) + p3 * to_float(v3[i]));
    }
  }
  for (; r < n; ++r) {
    const scalar_t* vr = v + r * stride;
    const float pr = p[r];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) acc[i] += pr * to_float(vr[i]);
  }
}

// float32 / bfloat16 fast path: the `G` query heads of one KV head against several key/value
// rows at once, in GCC vector extensions (8 floats; the compiler maps them to
// AVX2/AVX-512/NEON). bf16 K/V rows are widened to float on load (exact: bf16 is the top half
// of a float), so both dtypes accumulate in float in the same order.
// NOTE: one head at a time (dot_rows) loads each K chunk for one FMA; G heads x R rows load
// R + G chunks for R x G FMAs, and R x G independent accumulators hide the FMA latency.

// scores[g * sstride + r] = q_g . k_r for g < G, n rows k_r = k + r * stride; d % 8 == 0.
template <int G, typename kv_t>
void dot_group(const float* q, const kv_t* k, int64_t stride, int64_t n, int64_t d,
                   float* scores, int64_t sstride) {
  constexpr int R = G <= 4 ? 4 : 2;
  int64_t r = 0;
  for (; r + R <= n; r += R) {
    v8f acc[G][R] = {};
    for (int64_t i = 0; i < d; i += 8) {
      v8f kv[R];
      for (int j = 0; j < R; ++j) kv[j] = load8(k + (r + j) * stride + i);
      for (int g = 0; g < G; ++g) {
        const v8f qv = load8(q + g * d + i);
        for (int j = 0; j < R; ++j) acc[g][j] += qv * kv[j];
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int j = 0; j < R; ++j) scores[g * sstride + r + j] = hsum8(acc[g][j]);
    }
  }
  for (; r < n; ++r) {
    v8f acc[G] = {};
    for (int64_t i = 0; i < d; i += 8) {
      const v8f kv = load8(k + r * stride + i);
      for (int g = 0; g < G; ++g) acc[g] += load8(q + g * d + i) * kv;
    }
    for (int g = 0; g < G; ++g) scores[g * sstride + r] = hsum8(acc[g]);
  }
}

// acc[g] += sum_r p[g * pstride + r] * v_r for g < G, n rows v_r = v + r * stride; d % 8 == 0.
template <int G, typename kv_t>
void axpy_group(const float* p, int64_t pstride, const kv_t* v, int64_t stride, int64_t n,
                    int64_t d, float* acc) {
  for (int64_t i = 0; i < d; i += 8) {
    // NOTE: two accumulators per head (even and odd rows): twice the independent chains.
    v8f a[G], b[G];
    for (int g = 0; g < G; ++g) {
      a[g] = load8(acc + g * d + i);
      b[g] = v8f{};
    }
    int64_t r = 0;
    for (; r + 2 <= n; r += 2) {
      const v8f v0 = load8(v + r * stride + i);
      const v8f v1 = load8(v + (r + 1) * stride + i);
      for (int g = 0; g < G; ++g) {
        a[g] += p[g * pstride + r] * v0;
        b[g] += p[g * pstride + r + 1] * v1;
      }
    }
    if (r < n) {
      const v8f v0 = load8(v + r * stride + i);
      for (int g = 0; g < G; ++g) a[g] += p[g * pstride + r] * v0;
    }
    for (int g = 0; g < G; ++g) {
      const v8f sum = a[g] + b[g];
      std::memcpy(acc + g * d + i, &sum, sizeof(sum));
    }
  }
}

template <typename kv_t>
struct GroupKernels {
  void (*dot)(const float*, const kv_t*, int64_t, int64_t, int64_t, float*, int64_t);
  void (*axpy)(const float*, int64_t, const kv_t*, int64_t, int64_t, int64_t, float*);
};

// The group kernels for `group` query heads per KV head (nullptr: none).
template <typename kv_t>
inline const GroupKernels<kv_t>* group_kernels(int64_t group, int64_t d) {
  static const GroupKernels<kv_t> table[] = {
      {dot_group<1, kv_t>, axpy_group<1, kv_t>}, {dot_group<2, kv_t>, axpy_group<2, kv_t>},
      {dot_group<3, kv_t>, axpy_group<3, kv_t>}, {dot_group<4, kv_t>, axpy_group<4, kv_t>},
      {dot_group<5, kv_t>, axpy_group<5, kv_t>}, {dot_group<6, kv_t>, axpy_group<6, kv_t>},
      {dot_group<7, kv_t>, axpy_group<7, kv_t>}, {dot_group<8, kv_t>, axpy_group<8, kv_t>},
  };
  return group >= 1 && group <= 8 && d % 8 == 0 ? &table[group - 1] : nullptr;
}

template <typename scalar_t>
constexpr bool kHasGroupKernels =
    std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>;

}  // namespace kvserve
