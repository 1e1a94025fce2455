// What the K-quant kernels (quant_q4_k.cpp, quant_q5_k.cpp, quant_q6_k.cpp) share: the 6-bit
// scale / min unpacking of Q4_K and Q5_K, the AVX2 helpers and the tile runner that splits a
// tile of up to 4 rows x 4 tokens into the AVX2 kernels' 4 x 2 (or 1 x 2) tiles.
//
// Numerics (README.md, "K-quants"): the activations are the int8 blocks of 32 every kernel of
// the library uses (QAct: q, d = max|x| / 127, s = d * sum(q)); a K-quant sub-block lines up
// with them (Q4_K / Q5_K: 32 values, one activation block; Q6_K: 16 values, half of one).
// Per sub-block an exact integer dot, then fp32: Q4_K / Q5_K add
// (d * sc) * xd * dot - (dmin * m) * xs, Q6_K adds d * xd * (sc0 * dot0 + sc1 * dot1) (the
// two halves' int32 dots scaled in integers).
#pragma once

#include "quant_common.h"

namespace kvserve_quant {

// The 8 six-bit scales and mins of a Q4_K / Q5_K super-block (12 bytes at p), as
// gguf.quants.Q4_K.get_scale_min / llama.cpp's get_scale_min_k4 unpack them.
inline void kquant_scale_min(const uint8_t* p, uint8_t sc[8], uint8_t mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = p[j] & 0x3F;
    mn[j] = p[j + 4] & 0x3F;
    sc[j + 4] = static_cast<uint8_t>((p[j + 8] & 0x0F) | ((p[j] >> 2) & 0x30));
    mn[j + 4] = static_cast<uint8_t>((p[j + 8] >> 4) | ((p[j + 4] >> 2) & 0x30));
  }
}

#define KVQ_K_AVX2 __attribute__((target("avx2,fma,f16c")))

KVQ_K_AVX2 inline float kq_hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Eight int32 vectors (the lane sums of sub-blocks 0..7) -> one vector of their 8 totals,
// lane i = sub-block i: two levels of vphaddd, then the 128-bit halves added.
KVQ_K_AVX2 inline __m256i kq_sum8(__m256i d0, __m256i d1, __m256i d2, __m256i d3, __m256i d4,
                                  __m256i d5, __m256i d6, __m256i d7) {
  const __m256i q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(d0, d1), _mm256_hadd_epi32(d2, d3));
  const __m256i q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(d4, d5), _mm256_hadd_epi32(d6, d7));
  return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20),
                          _mm256_permute2x128_si256(q0, q1, 0x31));
}

// 8 bytes (uint8 or int8) -> 8 floats.
KVQ_K_AVX2 inline __m256 kq_u8x8_ps(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// The 8 sub-block int32 dots of one Q4_K / Q5_K super-block (its bytes after the scales and
// mins, blk + 16) with 256 activations x, lane i = sub-block i.
using KSuperDotsFn = __m256i (*)(const uint8_t* quants, const int8_t* x);

// The AVX2 tile of Q4_K / Q5_K (super-blocks of Bytes bytes, Dots their sub-block dots): per
// super-block and (row, token), the 8 sub-block dots in one vector, then in fp32
// (d sc) (xd) dot - (dmin m) xs lane by lane (lane i = sub-block i).
template <int R, int T, int64_t Bytes, KSuperDotsFn Dots>
KVQ_K_AVX2 void scale_min_tile_avx2(const uint8_t* w, int64_t row_bytes, const QAct& a,
                                    int64_t t0, float* res) {
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t s = 0; s < a.k / kSuper; ++s) {
    __m256 xd[T], xs[T];
    for (int t = 0; t < T; ++t) {
      xd[t] = _mm256_loadu_ps(a.d + (t0 + t) * a.nb + s * 8);
      xs[t] = _mm256_loadu_ps(a.s + (t0 + t) * a.nb + s * 8);
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * row_bytes + s * Bytes;
      _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * Bytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * Bytes + 64), _MM_HINT_T0);
      uint8_t sc[8], mn[8];
      kquant_scale_min(blk + 4, sc, mn);
      const __m256 ds = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(load_u16(blk))), kq_u8x8_ps(sc));
      const __m256 dm =
          _mm256_mul_ps(_mm256_set1_ps(-_cvtsh_ss(load_u16(blk + 2))), kq_u8x8_ps(mn));
      for (int t = 0; t < T; ++t) {
        const __m256i dots = Dots(blk + 16, a.q + (t0 + t) * a.k + s * kSuper);
        acc[r][t] =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(ds, xd[t]), acc[r][t]);
        acc[r][t] = _mm256_fmadd_ps(dm, xs[t], acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) res[r * T + t] = kq_hsum256(acc[r][t]);
}

// A kernel's tile: weight rows from w (row_bytes apart) x tokens t0.. of a, res [R][T].
using KTileFn = void (*)(const uint8_t* w, int64_t row_bytes, const QAct& a, int64_t t0,
                         float* res);
// One row's dot with token t (the scalar kernel).
using KDotFn = float (*)(const uint8_t* w, const QAct& a, int64_t t);

// The AVX2 kernels of one format: tiles[r == 4][T - 1] for R in {1, 4}, T in {1, 2}.
struct KTiles {
  KTileFn tiles[2][2];
};

constexpr int kKTileTokens = 2;  // NOTE: 16 ymm registers: 4 rows x 2 tokens of accumulators

// res [rows][tokens] on isa: the scalar dot per (row, token), or the AVX2 tiles.
inline void run_ktile(const KTiles& k, KDotFn scalar, const uint8_t* w, int64_t row_bytes,
                      int rows, const QAct& a, int64_t t0, int tokens, float* res, int isa) {
  if (isa == kIsaScalar) {
    for (int r = 0; r < rows; ++r)
      for (int t = 0; t < tokens; ++t) res[r * tokens + t] = scalar(w + r * row_bytes, a, t0 + t);
    return;
  }
  float tmp[4 * kKTileTokens];
  for (int tt = 0; tt < tokens; tt += kKTileTokens) {
    const int tn = std::min(kKTileTokens, tokens - tt);
    if (rows == 4) {
      k.tiles[1][tn - 1](w, row_bytes, a, t0 + tt, tmp);
      for (int r = 0; r < 4; ++r)
        for (int t = 0; t < tn; ++t) res[r * tokens + tt + t] = tmp[r * tn + t];
    } else {
      for (int r = 0; r < rows; ++r) {
        k.tiles[0][tn - 1](w + r * row_bytes, row_bytes, a, t0 + tt, tmp);
        for (int t = 0; t < tn; ++t) res[r * tokens + tt + t] = tmp[t];
      }
    }
  }
}

}  // namespace kvserve_quant
