// kvserve_quant::linear on the x16 layout (README.md): groups of 16 weight rows x up to 8
// tokens on AVX-512 VNNI, two 8-row halves on AVX2, the scalar dot elsewhere and on the plain
// tail rows.
#include "quant_common.h"

namespace kvserve_quant {

namespace {

// Token t's integer dot over one block: the sum of its two chains, or its one.
// NOTE: a helper, not a lambda: a lambda does not inherit the enclosing function's target
// attribute, so on a CPU without AVX-512 (where -march=native does not enable it) its
// intrinsics fail to inline and the whole file fails to build.
template <bool kTwoChains>
KVQ_AVX512 inline __m512i block_dot(__m512i dot0, __m512i dot1) {
  if constexpr (kTwoChains)
    return _mm512_add_epi32(dot0, dot1);
  else
    return dot0;
}

// One group of 16 rows x T tokens: res[t][i] = row i . token t0 + t.
// NOTE: up to 4 tokens each token's block dot runs as two chains (dot0 / dot1) so that
// enough `vpdpbusd` are in flight; from 5 tokens the tokens alone give that many chains, and
// one accumulator each leaves registers for 8 tokens (3 x 8 zmm would spill), so each
// unpacked weight vector serves twice the tokens. Integer sums: the result is the same.
template <int QT, int T>
KVQ_AVX512 void group_avx512(const uint8_t* g, const QAct& a, int64_t t0, float* res) {
  constexpr int64_t GB = kGroup * kBlockBytes[QT];  // bytes of one group-block
  constexpr int64_t VO = x16_values_offset(QT);
  constexpr bool kTwoChains = T <= 4;
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i u128 = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* xq[T];
  for (int t = 0; t < T; ++t) xq[t] = a.q + (t0 + t) * a.k;
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = g + b * GB;
    _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * GB), _MM_HINT_T0);
    // NOTE: the first pass over a group also pulls the next group (the same block of the
    // next 16 rows, a.nb blocks on) into L2, a whole group ahead: the 4-block L1 prefetch
    // alone hid too little of a cold read (Zen 4, projection sequence, best of 3 runs:
    // M = 8 / 16 / 32 5.3 / 9.5 / 15.7 -> 4.5 / 8.1 / 13.2 ms; M = 512 level).
    if (t0 == 0)
      for (int64_t l = 0; l < GB; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + a.nb * GB + l), _MM_HINT_T1);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    __m512i dot0[T], dot1[T];  // dot1: the second chains (kTwoChains only)
    // (dot1 is zeroed even when unused: block_dot takes it by value; the stores fold away.)
    for (int t = 0; t < T; ++t) dot0[t] = dot1[t] = _mm512_setzero_si512();
    if constexpr (QT == kQ8_0) {
      // dot(x, w) = dot(x + 128, w) - 128 sum(w): x + 128 is the unsigned operand.
      __m512i wsum = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        const __m512i wv = _mm512_loadu_si512(blk + VO + 64 * c);
        wsum = _mm512_dpbusd_epi32(wsum, u128, wv);
        for (int t = 0; t < T; ++t) {
          const __m512i xv =
              _mm512_set1_epi32(static_cast<int>(load_u32(reinterpret_cast<const uint8_t*>(
                                    xq[t] + b * kBlock + 4 * c)) ^ 0x80808080u));
          if constexpr (kTwoChains) {
            if (c & 1) {
              dot1[t] = _mm512_dpbusd_epi32(dot1[t], xv, wv);
              continue;
            }
          }
          dot0[t] = _mm512_dpbusd_epi32(dot0[t], xv, wv);
        }
      }
      for (int t = 0; t < T; ++t) {
        const __m512i dot = _mm512_sub_epi32(block_dot<kTwoChains>(dot0[t], dot1[t]), wsum);
        const __m512 scaled =
            _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(a.d[(t0 + t) * a.nb + b]));
        acc[t] = _mm512_fmadd_ps(scaled, dw, acc[t]);
      }
    } else {
      for (int c = 0; c < 4; ++c) {
        const __m512i wv = _mm512_loadu_si512(blk + VO + 64 * c);
        const __m512i lo = _mm512_and_si512(wv, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low4);
        for (int t = 0; t < T; ++t) {
          const uint8_t* xb = reinterpret_cast<const uint8_t*>(xq[t] + b * kBlock + 4 * c);
          const __m512i xlo = _mm512_set1_epi32(static_cast<int>(load_u32(xb)));
          const __m512i xhi = _mm512_set1_epi32(static_cast<int>(load_u32(xb + 16)));
          dot0[t] = _mm512_dpbusd_epi32(dot0[t], lo, xlo);
          if constexpr (kTwoChains)
            dot1[t] = _mm512_dpbusd_epi32(dot1[t], hi, xhi);
          else
            dot0[t] = _mm512_dpbusd_epi32(dot0[t], hi, xhi);
        }
      }
      __m512 mw;
      if constexpr (QT == kQ4_1)
        mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
      for (int t = 0; t < T; ++t) {
        const int64_t xi = (t0 + t) * a.nb + b;
        const __m512 dot = _mm512_cvtepi32_ps(block_dot<kTwoChains>(dot0[t], dot1[t]));
        if constexpr (QT == kQ4_0) {
          // d_w (d_x dot - 8 s_x)
          const __m512 v =
              _mm512_fmadd_ps(dot, _mm512_set1_ps(a.d[xi]), _mm512_set1_ps(-8.0f * a.s[xi]));
          acc[t] = _mm512_fmadd_ps(v, dw, acc[t]);
        } else {
          acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dot, _mm512_set1_ps(a.d[xi])), dw, acc[t]);
          acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[xi]), acc[t]);
        }
      }
    }
  }
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(res + t * kGroup, acc[t]);
}

// One half of a group (rows 8h .. 8h + 7) x T tokens on AVX2: res[t][8h + i] = row 8h + i .
// token t0 + t. A 32-byte half of a 64-byte chunk is 4 values of 8 rows, int32 lane i = row i.
// q4_*: vpmaddubsw (unsigned nibbles x signed activations) sums pairs into int16 and the
// block's 8 products per lane stay in int16 (at most 8 x 2 x 15 x 127 = 30480 < 32767); one
// vpmaddwd per block widens them. q8_0: |w| x (x signed as w), widened per chunk (one pair
// is already up to 2 x 128 x 127). NOTE: the halves run one after the other over all the
// blocks, not side by side: 16 ymm registers hold 2 accumulators for each of 4 tokens plus
// operands only with one half live. Each chunk's cache line holds both halves, so the second
// half reads the group from L1 where the first left it (a group is at most 16 x 48 blocks x
// 20 bytes = 15 KiB here).
template <int QT, int T>
KVQ_AVX2 void half_group_avx2(const uint8_t* g, const QAct& a, int64_t t0, int h, float* res) {
  constexpr int64_t GB = kGroup * kBlockBytes[QT];
  constexpr int64_t VO = x16_values_offset(QT);
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xq[T];
  for (int t = 0; t < T; ++t) xq[t] = a.q + (t0 + t) * a.k;
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = g + b * GB;
    if (h == 0 && t0 == 0)  // as the AVX-512 kernel: the next group's block into L2
      for (int64_t l = 0; l < GB; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + a.nb * GB + l), _MM_HINT_T1);
    const __m256 dw =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
    __m256i dot[T];
    for (int t = 0; t < T; ++t) dot[t] = _mm256_setzero_si256();
    if constexpr (QT == kQ8_0) {
      for (int c = 0; c < 8; ++c) {
        const __m256i wv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + VO + 64 * c + 32 * h));
        const __m256i aw = _mm256_sign_epi8(wv, wv);
        for (int t = 0; t < T; ++t) {
          const __m256i xv = _mm256_set1_epi32(static_cast<int>(
              load_u32(reinterpret_cast<const uint8_t*>(xq[t] + b * kBlock + 4 * c))));
          const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv));
          dot[t] = _mm256_add_epi32(dot[t], _mm256_madd_epi16(p, ones));
        }
      }
      for (int t = 0; t < T; ++t) {
        const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(dot[t]),
                                            _mm256_set1_ps(a.d[(t0 + t) * a.nb + b]));
        acc[t] = _mm256_fmadd_ps(scaled, dw, acc[t]);
      }
    } else {
      for (int c = 0; c < 4; ++c) {
        const __m256i wv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + VO + 64 * c + 32 * h));
        const __m256i lo = _mm256_and_si256(wv, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low4);
        for (int t = 0; t < T; ++t) {
          const uint8_t* xb = reinterpret_cast<const uint8_t*>(xq[t] + b * kBlock + 4 * c);
          const __m256i xlo = _mm256_set1_epi32(static_cast<int>(load_u32(xb)));
          const __m256i xhi = _mm256_set1_epi32(static_cast<int>(load_u32(xb + 16)));
          dot[t] = _mm256_add_epi16(dot[t], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo),
                                                             _mm256_maddubs_epi16(hi, xhi)));
        }
      }
      __m256 mw;
      if constexpr (QT == kQ4_1)
        mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * h)));
      for (int t = 0; t < T; ++t) {
        const int64_t xi = (t0 + t) * a.nb + b;
        const __m256 dot32 = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot[t], ones));
        if constexpr (QT == kQ4_0) {
          const __m256 v =
              _mm256_fmadd_ps(dot32, _mm256_set1_ps(a.d[xi]), _mm256_set1_ps(-8.0f * a.s[xi]));
          acc[t] = _mm256_fmadd_ps(v, dw, acc[t]);
        } else {
          acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dot32, _mm256_set1_ps(a.d[xi])), dw, acc[t]);
          acc[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[xi]), acc[t]);
        }
      }
    }
  }
  for (int t = 0; t < T; ++t) _mm256_storeu_ps(res + t * kGroup + 8 * h, acc[t]);
}

template <int QT, int T>
void group_avx2(const uint8_t* g, const QAct& a, int64_t t0, float* res) {
  half_group_avx2<QT, T>(g, a, t0, 0, res);
  half_group_avx2<QT, T>(g, a, t0, 1, res);
}

using GroupFn = void (*)(const uint8_t*, const QAct&, int64_t, float*);

constexpr int kGroupTokens = 8;  // tokens per pass over a group's blocks

constexpr int kGroupTokensAvx2 = 4;

template <int QT>
void group_table_avx2(GroupFn fns[kGroupTokens]) {
  fns[0] = &group_avx2<QT, 1>;
  fns[1] = &group_avx2<QT, 2>;
  fns[2] = &group_avx2<QT, 3>;
  fns[3] = &group_avx2<QT, 4>;
}

template <int QT>
void group_table(GroupFn fns[kGroupTokens]) {
  fns[0] = &group_avx512<QT, 1>;
  fns[1] = &group_avx512<QT, 2>;
  fns[2] = &group_avx512<QT, 3>;
  fns[3] = &group_avx512<QT, 4>;
  fns[4] = &group_avx512<QT, 5>;
  fns[5] = &group_avx512<QT, 6>;
  fns[6] = &group_avx512<QT, 7>;
  fns[7] = &group_avx512<QT, 8>;
}

// res [tokens][16] (+ bias [16]) -> out rows t, columns row0 .. row0 + 15, rounded as
// static_cast<scalar_t> rounds (bf16: to nearest even, NaN -> 0x7FC0). float or bf16 only.
template <typename scalar_t>
constexpr bool kVectorStore =
    std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>;

template <typename scalar_t>
KVQ_AVX512 void store_group_avx512(const float* res, int tokens, const float* bias,
                                   scalar_t* op, int64_t out_stride) {
  const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int t = 0; t < tokens; ++t) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(res + t * kGroup), b);
    scalar_t* o = op + t * out_stride;
    if constexpr (std::is_same_v<scalar_t, float>) {
      _mm512_storeu_ps(o, v);
    } else {
      const __m512i bits = _mm512_castps_si512(v);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
      const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __m512i r = _mm512_mask_blend_epi32(nan, _mm512_srli_epi32(up, 16),
                                                _mm512_set1_epi32(0x7FC0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(r));
    }
  }
}

// The x16 layout's rows (README.md): groups on the AVX-512 kernel or the scalar one,
// the plain tail rows on the scalar dot.

}  // namespace

template <typename scalar_t>
void run_linear_x16(const QAct& act, int64_t m, const uint8_t* wp, int64_t n, int64_t row_bytes,
                    int qtype, const float* bias, scalar_t* op, int64_t out_stride, int isa) {
  const int64_t groups = n / kGroup, grouped = groups * kGroup;
  GroupFn fns[kGroupTokens] = {};
  if (isa == kIsaAvx512Vnni) {
    if (qtype == kQ8_0) group_table<kQ8_0>(fns);
    if (qtype == kQ4_0) group_table<kQ4_0>(fns);
    if (qtype == kQ4_1) group_table<kQ4_1>(fns);
  } else if (isa == kIsaAvx2) {
    if (qtype == kQ8_0) group_table_avx2<kQ8_0>(fns);
    if (qtype == kQ4_0) group_table_avx2<kQ4_0>(fns);
    if (qtype == kQ4_1) group_table_avx2<kQ4_1>(fns);
  }
  auto scalar_dot = [&](int64_t row, int64_t t) -> float {
    if (qtype == kQ8_0) return dot_row_scalar_x16<kQ8_0>(wp, row_bytes, grouped, row, act, t);
    if (qtype == kQ4_0) return dot_row_scalar_x16<kQ4_0>(wp, row_bytes, grouped, row, act, t);
    return dot_row_scalar_x16<kQ4_1>(wp, row_bytes, grouped, row, act, t);
  };
  auto store = [&](int64_t row, int64_t t, float v) {
    op[t * out_stride + row] = static_cast<scalar_t>(v + (bias != nullptr ? bias[row] : 0.0f));
  };
  // NOTE: ~32 KiB of weights per task, as the plain layout's tiles.
  const int64_t grain =
      std::max<int64_t>(1, 32768 / (kGroup * row_bytes * std::max<int64_t>(m, 1)));
  at::parallel_for(0, groups + (n > grouped ? 1 : 0), grain, [&](int64_t begin, int64_t end) {
    float res[kGroup * kGroupTokens];
    for (int64_t g = begin; g < end; ++g) {
      if (g == groups) {  // the plain tail rows
        for (int64_t row = grouped; row < n; ++row)
          for (int64_t t = 0; t < m; ++t) store(row, t, scalar_dot(row, t));
        continue;
      }
      const uint8_t* gp = wp + g * kGroup * row_bytes;
      const int step = isa == kIsaAvx512Vnni ? kGroupTokens : kGroupTokensAvx2;
      for (int64_t t0 = 0; t0 < m; t0 += step) {
        const int tokens = static_cast<int>(std::min<int64_t>(step, m - t0));
        if (isa != kIsaScalar) {
          fns[tokens - 1](gp, act, t0, res);
          if constexpr (kVectorStore<scalar_t>) {
            if (isa == kIsaAvx512Vnni) {
              store_group_avx512<scalar_t>(res, tokens,
                                           bias != nullptr ? bias + g * kGroup : nullptr,
                                           op + t0 * out_stride + g * kGroup, out_stride);
              continue;
            }
          }
        } else {
          for (int t = 0; t < tokens; ++t)
            for (int i = 0; i < kGroup; ++i) res[t * kGroup + i] = scalar_dot(g * kGroup + i, t0 + t);
        }
        for (int t = 0; t < tokens; ++t)
          for (int i = 0; i < kGroup; ++i) store(g * kGroup + i, t0 + t, res[t * kGroup + i]);
      }
    }
  });
}

template void run_linear_x16<double>(const QAct&, int64_t, const uint8_t*, int64_t, int64_t, int,
                                     const float*, double*, int64_t, int);
template void run_linear_x16<float>(const QAct&, int64_t, const uint8_t*, int64_t, int64_t, int,
                                    const float*, float*, int64_t, int);
template void run_linear_x16<c10::Half>(const QAct&, int64_t, const uint8_t*, int64_t, int64_t,
                                        int, const float*, c10::Half*, int64_t, int);
template void run_linear_x16<c10::BFloat16>(const QAct&, int64_t, const uint8_t*, int64_t,
                                            int64_t, int, const float*, c10::BFloat16*, int64_t,
                                            int);

}  // namespace kvserve_quant
