// The vector header of the instruction set this build targets (-march, see README.md), and
// which wide kernels that makes available:
//   AVX-512F            vec_avx512.h  KVSERVE_WIDE_ATTN (16-row decode attention passes)
//   + AVX512BW/VL                     KVSERVE_WIDE_SILU (masked 16-lane silu_mul, rms_norm,
//                                     argmax: KVSERVE_WIDE_ARGMAX)
//   AVX2 + FMA, no AVX-512F vec_avx2.h KVSERVE_WIDE_ATTN (8-row passes), KVSERVE_AVX2_SILU
//   anything else       vec_scalar.h only: the portable kernels (`#pragma omp simd`, v8f)
#pragma once

#include "vec_scalar.h"

#if defined(__AVX512F__)
#include "vec_avx512.h"
#define KVSERVE_WIDE_ATTN 1
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVSERVE_WIDE_SILU 1
#define KVSERVE_WIDE_ARGMAX 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include "vec_avx2.h"
#define KVSERVE_WIDE_ATTN 1
#define KVSERVE_AVX2_SILU 1
#endif
