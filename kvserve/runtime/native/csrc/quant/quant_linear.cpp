// kvserve_quant::linear on the plain layout: the activations quantized per block of 32 to
// int8, then tiles of 4 weight rows x up to 4 tokens on the chosen instruction set (scalar,
// AVX2, AVX-VNNI, AVX-512 VNNI; each compiled with its target attribute and chosen at run
// time). The x16 layout's rows: quant_linear_x16.cpp.
#include "quant_common.h"

namespace kvserve_quant {

namespace {

// ---- activations -----------------------------------------------------------------------

// One token's activations as int8 blocks: q [K], d [K / 32], s = d * sum(q) [K / 32].
template <typename scalar_t>
void quantize_row(const scalar_t* x, int64_t k, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    float v[kBlock];
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) {
      v[i] = static_cast<float>(x[b * kBlock + i]);
      amax = std::max(amax, std::fabs(v[i]));
    }
    const float scale = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      // NOTE: |v * inv| <= 127 up to rounding; the clamp keeps -128 out, which the sign
      // trick of the AVX2 path could not negate.
      const int qi = std::clamp(static_cast<int>(std::nearbyint(v[i] * inv)), -127, 127);
      q[b * kBlock + i] = static_cast<int8_t>(qi);
      sum += qi;
    }
    d[b] = scale;
    s[b] = scale * static_cast<float>(sum);
  }
}

// The same as quantize_row for fp32 / bf16 rows with AVX-512 (bit-identical: the same fp32
// max, product and round-to-nearest-even as std::nearbyint, exact integer sums).
template <typename scalar_t>
KVQ_AVX512 inline __m512 load16_ps(const scalar_t* x) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm512_loadu_ps(x);
  } else {  // bf16: the upper half of an fp32
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <typename scalar_t>
KVQ_AVX512 void quantize_row_avx512(const scalar_t* x, int64_t k, int8_t* q, float* d, float* s) {
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const __m512 v0 = load16_ps(x + b * kBlock), v1 = load16_ps(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512 vinv = _mm512_set1_ps(inv);
    // NOTE: clamp in float then round: the same as rounding then clamping to [-127, 127].
    const __m512i q0 = _mm512_cvtps_epi32(
        _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v0, vinv), lo), hi));
    const __m512i q1 = _mm512_cvtps_epi32(
        _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v1, vinv), lo), hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16), _mm512_cvtsepi32_epi8(q1));
    const float scale = amax / 127.0f;
    d[b] = scale;
    s[b] = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

template <typename scalar_t>
void quantize_activations(const scalar_t* x, int64_t k, int8_t* q, float* d, float* s, int isa) {
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    if (isa == kIsaAvx512Vnni) return quantize_row_avx512(x, k, q, d, s);
  }
  quantize_row(x, k, q, d, s);
}

template <int QT>
void tile_scalar(const uint8_t* w, int64_t row_bytes, int rows, const QAct& a, int64_t t0,
                 int tokens, float* res /* [rows][tokens] */) {
  for (int r = 0; r < rows; ++r)
    for (int t = 0; t < tokens; ++t)
      res[r * tokens + t] = dot_row_scalar<QT>(w + r * row_bytes, a, t0 + t);
}

// ---- AVX2 / AVX-VNNI (32 values per step) -----------------------------------------------

// sum of u8 x s8 products in groups of 4 -> int32 lanes.
KVQ_AVXVNNI inline __m256i dot_u8s8_vnni(__m256i a, __m256i b) {
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b);
}

KVQ_AVX2 inline __m256i dot_u8s8_avx2(__m256i a, __m256i b) {
  // NOTE: vpmaddubsw saturates at int16; |a| <= 128 and |b| <= 127 keep each pair below it.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
}

KVQ_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// NOTE: the Q4_1 min term uses an explicit fma: left as `macc += mw * xs`, GCC contracted it
// in some token counts T and not in others, so a token's output changed with its batch.
#define KVQ_TILE256_BODY(DOT)                                                                 \
  __m256 acc[R][T];                                                                          \
  float macc[R][T];                                                                          \
  for (int r = 0; r < R; ++r)                                                                \
    for (int t = 0; t < T; ++t) {                                                            \
      acc[r][t] = _mm256_setzero_ps();                                                       \
      macc[r][t] = 0.0f;                                                                     \
    }                                                                                        \
  const __m128i low4 = _mm_set1_epi8(0x0F);                                                  \
  for (int64_t b = 0; b < a.nb; ++b) {                                                       \
    __m256i xv[T];                                                                           \
    float xd[T], xs[T];                                                                      \
    for (int t = 0; t < T; ++t) {                                                            \
      xv[t] = _mm256_loadu_si256(                                                            \
          reinterpret_cast<const __m256i*>(a.q + (t0 + t) * a.k + b * kBlock));              \
      xd[t] = a.d[(t0 + t) * a.nb + b];                                                      \
      xs[t] = a.s[(t0 + t) * a.nb + b];                                                      \
    }                                                                                        \
    for (int r = 0; r < R; ++r) {                                                            \
      const uint8_t* blk = w + r * row_bytes + b * kBlockBytes[QT];                          \
      const float dw = _cvtsh_ss(load_u16(blk));                                             \
      if constexpr (QT == kQ8_0) {                                                           \
        const __m256i qw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));    \
        const __m256i aw = _mm256_sign_epi8(qw, qw);                                         \
        for (int t = 0; t < T; ++t) {                                                        \
          const __m256i dot = DOT(aw, _mm256_sign_epi8(xv[t], qw));                          \
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * xd[t]),   \
                                      acc[r][t]);                                            \
        }                                                                                    \
      } else {                                                                               \
        const __m128i v =                                                                    \
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (QT == kQ4_0 ? 2 : 4)));  \
        const __m256i qw = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low4),       \
                                            _mm_and_si128(v, low4));                         \
        const float mw = QT == kQ4_0 ? -8.0f * dw : _cvtsh_ss(load_u16(blk + 2));            \
        for (int t = 0; t < T; ++t) {                                                        \
          const __m256i dot = DOT(qw, xv[t]);                                                \
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * xd[t]),   \
                                      acc[r][t]);                                            \
          macc[r][t] = std::fma(mw, xs[t], macc[r][t]);                                      \
        }                                                                                    \
      }                                                                                      \
    }                                                                                        \
  }                                                                                          \
  for (int r = 0; r < R; ++r)                                                                \
    for (int t = 0; t < T; ++t) res[r * T + t] = hsum256(acc[r][t]) + macc[r][t];

template <int QT, int R, int T>
KVQ_AVX2 void tile_avx2(const uint8_t* w, int64_t row_bytes, const QAct& a, int64_t t0,
                        float* res) {
  KVQ_TILE256_BODY(dot_u8s8_avx2)
}

template <int QT, int R, int T>
KVQ_AVXVNNI void tile_avxvnni(const uint8_t* w, int64_t row_bytes, const QAct& a, int64_t t0,
                              float* res) {
  KVQ_TILE256_BODY(dot_u8s8_vnni)
}

// ---- AVX-512 VNNI (64 values = two blocks per step) -------------------------------------

template <int QT, int R, int T>
KVQ_AVX512 void tile_avx512(const uint8_t* w, int64_t row_bytes, const QAct& a, int64_t t0,
                            float* res) {
  constexpr int64_t BB = kBlockBytes[QT];
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  const __m512i perm = _mm512_set_epi64(7, 6, 3, 2, 5, 4, 1, 0);  // qwords 0,1,4,5,2,3,6,7
  const __m512i sign_bit = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  // The int32 lanes of block b + 1 (the others hold block b): q8_0 keeps values in order
  // (lanes 8..15); the nibble formats unpack to [b lo, b+1 lo, b hi, b+1 hi] (16 bytes each,
  // lanes 4..7 and 12..15). pick2: lane -> index into [s_b, s_b+1]; pick_d / pick_m: into
  // the weights' fp16 fields [d_b, m_b, d_b+1, m_b+1].
  const __m512i pick2 =
      QT == kQ8_0 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                  : _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i pick_d = _mm512_add_epi32(pick2, pick2);
  const __m512i pick_m = _mm512_add_epi32(pick_d, _mm512_set1_epi32(1));
  const int64_t pairs = a.nb / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t b = 2 * p;
    __m512i xv[T];
    __m512 xd[T], xs[T];
    for (int t = 0; t < T; ++t) {
      const int64_t row = t0 + t;
      const __m512i v = _mm512_loadu_si512(a.q + row * a.k + b * kBlock);
      // q8_0: x + 128 as unsigned (the weights are the signed operand); nibbles: reorder.
      xv[t] = QT == kQ8_0 ? _mm512_xor_si512(v, sign_bit) : _mm512_permutexvar_epi64(perm, v);
      const __m128 d2 = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(a.d + row * a.nb + b)));
      xd[t] = _mm512_permutexvar_ps(pick2, _mm512_castps128_ps512(d2));
      if constexpr (QT != kQ8_0) {
        __m128 s2 = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(a.s + row * a.nb + b)));
        if constexpr (QT == kQ4_0) s2 = _mm_mul_ps(s2, _mm_set1_ps(-8.0f));
        xs[t] = _mm512_permutexvar_ps(pick2, _mm512_castps128_ps512(s2));
      }
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * row_bytes + b * BB;
      _mm_prefetch(reinterpret_cast<const char*>(blk + 8 * BB), _MM_HINT_T0);
      // fp16 fields of both blocks in one conversion: [d_b, m_b, d_b+1, m_b+1] (q4_0 / q8_0:
      // the "m" halves are the first value bytes, unused).
      const __m512 f = _mm512_castps128_ps512(
          _mm_cvtph_ps(_mm_set_epi32(0, 0, static_cast<int>(load_u32(blk + BB)),
                                     static_cast<int>(load_u32(blk)))));
      const __m512 dw = _mm512_permutexvar_ps(pick_d, f);
      if constexpr (QT == kQ8_0) {
        const __m512i qw = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + BB + 2)), 1);
        // dot(x, w) = dot(x + 128, w) - 128 sum(w): start every lane at -128 sum(w).
        const __m512i bias =
            _mm512_sub_epi32(_mm512_setzero_si512(),
                             _mm512_dpbusd_epi32(_mm512_setzero_si512(), sign_bit, qw));
        for (int t = 0; t < T; ++t) {
          const __m512i dot = _mm512_dpbusd_epi32(bias, xv[t], qw);
          acc[r][t] =
              _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, xd[t]), acc[r][t]);
        }
      } else {
        constexpr int off = QT == kQ4_0 ? 2 : 4;
        const __m256i v = _mm256_set_m128i(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + BB + off)),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + off)));
        const __m512i qw =
            _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, low4)),
                               _mm256_and_si256(_mm256_srli_epi16(v, 4), low4), 1);
        // The offset term once per block: lanes 0 (block b) and 4 (block b + 1) only.
        const __m512 mw = QT == kQ4_0 ? _mm512_maskz_mov_ps(0x0011, dw)
                                      : _mm512_maskz_permutexvar_ps(0x0011, pick_m, f);
        for (int t = 0; t < T; ++t) {
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qw, xv[t]);
          acc[r][t] =
              _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, xd[t]), acc[r][t]);
          acc[r][t] = _mm512_fmadd_ps(mw, xs[t], acc[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) {
      float sum = _mm512_reduce_add_ps(acc[r][t]);
      if (a.nb & 1) {  // the odd last block, scalar
        const int64_t b = a.nb - 1, row = t0 + t;
        const QAct one{a.q + row * a.k + b * kBlock, a.d + row * a.nb + b, a.s + row * a.nb + b,
                       kBlock, 1};
        sum += dot_row_scalar<QT>(w + r * row_bytes + b * BB, one, 0);
      }
      res[r * T + t] = sum;
    }
  }
}

// ---- dispatch ----------------------------------------------------------------------------

using TileFn = void (*)(const uint8_t*, int64_t, const QAct&, int64_t, float*);

template <int QT, int R, int T>
TileFn tile_fn(int isa) {
  switch (isa) {
    case kIsaAvx512Vnni:
      return &tile_avx512<QT, R, T>;
    case kIsaAvxVnni:
      return &tile_avxvnni<QT, R, T>;
    case kIsaAvx2:
      return &tile_avx2<QT, R, T>;
    default:
      return nullptr;
  }
}

constexpr int kRows = 4;

// Tile functions for R in {1, 4} x T in {1..4}: fns[r == 4][t - 1].
template <int QT>
void tile_table(int isa, TileFn fns[2][4]) {
  fns[0][0] = tile_fn<QT, 1, 1>(isa);
  fns[0][1] = tile_fn<QT, 1, 2>(isa);
  fns[0][2] = tile_fn<QT, 1, 3>(isa);
  fns[0][3] = tile_fn<QT, 1, 4>(isa);
  fns[1][0] = tile_fn<QT, 4, 1>(isa);
  fns[1][1] = tile_fn<QT, 4, 2>(isa);
  fns[1][2] = tile_fn<QT, 4, 3>(isa);
  fns[1][3] = tile_fn<QT, 4, 4>(isa);
}

int max_tokens_per_tile(int isa) {
  // NOTE: 16 ymm registers hold 4 x 2 accumulators plus operands; 32 zmm hold 4 x 4.
  return isa == kIsaAvx512Vnni ? 4 : 2;
}

// The K-quants (quant_q4_k.cpp, quant_q5_k.cpp, quant_q6_k.cpp): tiles of 4 rows x up to 4
// tokens, split as the other formats' tiles are.
template <typename scalar_t>
void run_linear_kquant(const QAct& act, int64_t m, const uint8_t* wp, int64_t n,
                       int64_t row_bytes, int qtype, const float* bias, scalar_t* op,
                       int64_t out_stride, int isa) {
  auto* tile = qtype == kQ4_K ? &q4_k_tile : qtype == kQ5_K ? &q5_k_tile : &q6_k_tile;
  constexpr int max_t = 4;
  const int64_t tiles = (n + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, 32768 / (kRows * row_bytes * std::max<int64_t>(m, 1)));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    float res[kRows * max_t];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t * kRows;
      const int rows = static_cast<int>(std::min<int64_t>(kRows, n - r0));
      for (int64_t t0 = 0; t0 < m; t0 += max_t) {
        const int tokens = static_cast<int>(std::min<int64_t>(max_t, m - t0));
        tile(wp + r0 * row_bytes, row_bytes, rows, act, t0, tokens, res, isa);
        for (int r = 0; r < rows; ++r) {
          const float b = bias != nullptr ? bias[r0 + r] : 0.0f;
          for (int i = 0; i < tokens; ++i)
            op[(t0 + i) * out_stride + r0 + r] = static_cast<scalar_t>(res[r * tokens + i] + b);
        }
      }
    }
  });
}

template <typename scalar_t>
void run_linear(const Tensor& x, const Tensor& weight, int qtype, const float* bias, Tensor& out,
                int isa, int layout) {
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  const int64_t row_bytes = weight.size(1), nb = k / kBlock;
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const uint8_t* wp = weight.data_ptr<uint8_t>();

  thread_local std::vector<int8_t> q_buf;
  thread_local std::vector<float> d_buf, s_buf;
  q_buf.resize(static_cast<size_t>(m * k));
  d_buf.resize(static_cast<size_t>(m * nb));
  s_buf.resize(static_cast<size_t>(m * nb));
  int8_t* qp = q_buf.data();
  float* dp = d_buf.data();
  float* sp = s_buf.data();
  const int64_t token_grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, k));
  at::parallel_for(0, m, token_grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      quantize_activations(xp + t * x_stride, k, qp + t * k, dp + t * nb, sp + t * nb, isa);
  });
  const QAct act{qp, dp, sp, k, nb};
  if (layout == kGroup) {
    run_linear_x16<scalar_t>(act, m, wp, n, row_bytes, qtype, bias, op, out_stride, isa);
    return;
  }

  if (is_kquant(qtype)) {
    run_linear_kquant(act, m, wp, n, row_bytes, qtype, bias, op, out_stride, isa);
    return;
  }
  TileFn fns[2][4] = {};
  if (isa != kIsaScalar) {
    if (qtype == kQ8_0) tile_table<kQ8_0>(isa, fns);
    if (qtype == kQ4_0) tile_table<kQ4_0>(isa, fns);
    if (qtype == kQ4_1) tile_table<kQ4_1>(isa, fns);
  }
  const int max_t = max_tokens_per_tile(isa);
  const int64_t tiles = (n + kRows - 1) / kRows;
  // NOTE: ~32 KiB of weights per task: enough to amortise the fork, fine enough that two
  // threads split a 576-row matrix evenly.
  const int64_t grain = std::max<int64_t>(1, 32768 / (kRows * row_bytes * std::max<int64_t>(m, 1)));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    float res[kRows * 4];
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t r0 = tile * kRows;
      const int rows = static_cast<int>(std::min<int64_t>(kRows, n - r0));
      for (int64_t t0 = 0; t0 < m; t0 += max_t) {
        const int tokens = static_cast<int>(std::min<int64_t>(max_t, m - t0));
        if (isa == kIsaScalar) {
          if (qtype == kQ8_0) tile_scalar<kQ8_0>(wp + r0 * row_bytes, row_bytes, rows, act, t0, tokens, res);
          if (qtype == kQ4_0) tile_scalar<kQ4_0>(wp + r0 * row_bytes, row_bytes, rows, act, t0, tokens, res);
          if (qtype == kQ4_1) tile_scalar<kQ4_1>(wp + r0 * row_bytes, row_bytes, rows, act, t0, tokens, res);
        } else if (rows == kRows) {
          fns[1][tokens - 1](wp + r0 * row_bytes, row_bytes, act, t0, res);
        } else {
          for (int r = 0; r < rows; ++r)
            fns[0][tokens - 1](wp + (r0 + r) * row_bytes, row_bytes, act, t0, res + r * tokens);
        }
        for (int r = 0; r < rows; ++r) {
          const float b = bias != nullptr ? bias[r0 + r] : 0.0f;
          for (int t = 0; t < tokens; ++t)
            op[(t0 + t) * out_stride + r0 + r] = static_cast<scalar_t>(res[r * tokens + t] + b);
        }
      }
    }
  });
}

}  // namespace

void check_weight(const Tensor& weight, int64_t qtype, int64_t k) {
  TORCH_CHECK(qtype >= 0 && qtype < kNumQtypes, "kvserve_quant: unknown qtype code ", qtype);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.dim() == 2 &&
                  weight.is_contiguous(),
              "kvserve_quant: weight must be a contiguous CPU uint8 [N, row_bytes] tensor");
  const int q = static_cast<int>(qtype);
  TORCH_CHECK(k % qtype_block(q) == 0, "kvserve_quant: in_features ", k,
              " is not a multiple of ", qtype_block(q));
  TORCH_CHECK(weight.size(1) == qtype_row_bytes(q, k), "kvserve_quant: weight rows have ",
              weight.size(1), " bytes, expected ", qtype_row_bytes(q, k), " for ", k, " inputs");
}

// out [M, N] (rows contiguous, any row stride: a column slice of a wider buffer works) =
// x [M, K] @ dequant(weight)^T (+ bias [N], float32).
void quant_linear(Tensor out, const Tensor& x, const Tensor& weight, int64_t qtype,
                  const std::optional<Tensor>& bias, int64_t isa, int64_t layout) {
  TORCH_CHECK(layout == 0 || layout == kGroup, "kvserve_quant: unknown layout code ", layout,
              " (0 = plain, 16 = x16)");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              "kvserve_quant: x must be a 2-D CPU tensor with contiguous rows");
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.stride(1) == 1,
              "kvserve_quant: out must be a 2-D CPU tensor with contiguous rows");
  check_weight(weight, qtype, x.size(1));
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == weight.size(0),
              "kvserve_quant: out must be [", x.size(0), ", ", weight.size(0), "], got ",
              out.sizes());
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "kvserve_quant: out and x dtypes differ");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == weight.size(0),
                "kvserve_quant: bias must be float32 [N]");
    bp = bias->data_ptr<float>();
  }
  int chosen = isa == kIsaAuto ? best_isa() : static_cast<int>(isa);
  TORCH_CHECK(isa_supported(chosen), "kvserve_quant: instruction set ", isa,
              " is not supported by this CPU");
  TORCH_CHECK(layout == 0 || chosen == kIsaAvx512Vnni || chosen == kIsaAvx2 ||
                  chosen == kIsaScalar,
              "kvserve_quant: the x16 layout runs on avx512_vnni, avx2 or scalar, not on isa ",
              chosen);
  TORCH_CHECK(layout == 0 || !is_kquant(static_cast<int>(qtype)),
              "kvserve_quant: the K-quants have no x16 layout");
  if (x.size(0) == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quant_linear", [&] {
    run_linear<scalar_t>(x, weight, static_cast<int>(qtype), bp, out, chosen,
                         static_cast<int>(layout));
  });
}

}  // namespace kvserve_quant
