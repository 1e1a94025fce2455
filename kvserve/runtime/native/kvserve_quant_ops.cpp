// kvserve quantized-weight kernels: y = x @ W^T (+ b) with W in GGML block formats.
//
// Registered as torch custom ops in the `kvserve_quant` namespace, CPU only. Weights stay in
// the GGUF block layout, one row of blocks per output feature (uint8 [N, row_bytes]):
//   q8_0: 34 bytes per 32 values: fp16 d, 32 x int8 q              x = d * q
//   q4_0: 18 bytes per 32 values: fp16 d, 16 bytes of nibbles      x = d * (q - 8)
//   q4_1: 20 bytes per 32 values: fp16 d, fp16 m, 16 bytes nibbles x = d * q + m
// (nibble byte j holds value j in its low half and value j + 16 in its high half). The
// K-quants are repacked to these at load (kvserve/models/quant.py).
//
// Activations are quantized per block of 32 to int8 on the fly, as llama.cpp does (its
// q8_0 / q8_1 activation blocks): d_x = max|x| / 127, q_x = round(x / d_x), and
// s_x = d_x * sum(q_x) for the nibble formats' offset term. A block's contribution is then
//   q8_0: d_w d_x sum(q_w q_x)
//   q4_0: d_w d_x sum(n_w q_x) - 8 d_w s_x
//   q4_1: d_w d_x sum(n_w q_x) + m_w s_x
// with exact integer dot products and fp32 accumulation of the scaled block sums.
//
// Instruction sets, chosen at run time by CPU flags within the build's -march target (each can
// be forced for tests):
//   avx512_vnni: 64 values (two blocks) per vpdpbusd, 4 rows x up to 4 tokens per tile;
//   avx_vnni:    32 values per VEX vpdpbusd (Alder Lake and later without AVX-512);
//   avx2:        32 values per vpmaddubsw + vpmaddwd;
//   scalar:      plain C++ integer loops.
// Work splits over output rows (tiles of 4 rows) with at::parallel_for: each thread streams
// its own rows once and reuses each tile for all tokens while it sits in L1.
//
// Layout "x16" (layout code 16, made once at load by kvserve/models/quant.py:interleave_x16):
// the first N - N % 16 rows in groups of 16, each group's block b stored as one run of 16 x
// block bytes: the 16 fp16 d (q4_1: then the 16 fp16 m), then the values in chunks of 4 bytes,
// chunk-major: [chunk c][row i][4 bytes] (q8_0: 8 chunks of values 4c..4c+3; q4_*: 4 chunks of
// nibble bytes 4c..4c+3, i.e. values 4c..4c+3 low and 16+4c..16+4c+3 high). One 64-byte load
// is then one chunk of all 16 rows, int32 lane i = row i: a vpdpbusd against 4 broadcast
// activation bytes advances 16 rows at once, and the scales of 16 rows are one load, so the
// per-block scale arithmetic is shared by 16 rows instead of done per row (the AVX-512 GEMV
// of the plain layout is compute bound at about half the read bandwidth). The last N % 16 rows
// stay plain. Instruction sets for x16: avx512_vnni, avx2 (two 8-row halves per group) and
// scalar; on AMX CPUs `amx_bf16_linear` (below) multiplies bf16 activations by x16 weights
// dequantized inside an AMX bf16 GEMM.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVQ_HAVE_AMX 1
#include "kvserve_amx_tiles.h"  // the tile state request and configuration (shared)
#endif

namespace kvserve_quant {
namespace {

using at::Tensor;

constexpr int kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2;
constexpr int64_t kBlock = 32;
constexpr int64_t kBlockBytes[3] = {34, 18, 20};

constexpr int kIsaAuto = 0, kIsaScalar = 1, kIsaAvx2 = 2, kIsaAvxVnni = 3, kIsaAvx512Vnni = 4;

#define KVQ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define KVQ_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KVQ_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

// Whether this build has the AMX kernel and the kernel granted this process the tile state.
bool amx_tiles_ready() {
#if defined(KVQ_HAVE_AMX)
  return kvserve::amx_tiles_granted();
#else
  return false;
#endif
}

// Whether a build for a named target (KVSERVE_EMULATED_TARGET: KVSERVE_NATIVE_MARCH set,
// kvserve/runtime/native/__init__.py) has the instruction set; a native build: always.
// NOTE: why. The kernels are compiled for every instruction set (target attributes) and chosen
// by the CPU's flags, but a build for an older CPU kind than this one is there to run that
// kind's code paths here, the tests of the other kinds and their speed: without this cap an
// x86-64-v3 build ran the AVX-512 VNNI kernels on an AVX-512 CPU. A native build is left to
// the CPU's flags alone, so a compiler that knows a CPU less well than cpuid does (gcc 12 has
// no znver4 target) loses no kernel.
constexpr bool target_has(int isa) {
#if !defined(KVSERVE_EMULATED_TARGET)
  static_cast<void>(isa);
  return true;
#endif
  switch (isa) {
    case kIsaAvx2:
#if defined(__AVX2__) && defined(__FMA__)
      return true;
#else
      return false;
#endif
    case kIsaAvxVnni:
#if defined(__AVX2__) && defined(__FMA__) && defined(__AVXVNNI__)
      return true;
#else
      return false;
#endif
    case kIsaAvx512Vnni:
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__AVX512VNNI__)
      return true;
#else
      return false;
#endif
    default:
      return true;
  }
}

bool cpu_has(int isa) {
  __builtin_cpu_init();
  switch (isa) {
    case kIsaScalar:
      return true;
    case kIsaAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kIsaAvxVnni:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("avxvnni");
    case kIsaAvx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vnni");
    default:
      return false;
  }
}

bool isa_supported(int isa) { return cpu_has(isa) && target_has(isa); }

int best_isa() {
  static const int best = [] {
    for (int isa : {kIsaAvx512Vnni, kIsaAvxVnni, kIsaAvx2})
      if (isa_supported(isa)) return isa;
    return kIsaScalar;
  }();
  return best;
}

// IEEE half -> float without F16C (the scalar path must run anywhere).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float load_half(const uint8_t* p) { return half_to_float(load_u16(p)); }

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

// Quantized activations of M tokens: row m at q + m * k, d / s + m * nb.
struct QAct {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t k;
  int64_t nb;
};

// ---- scalar ------------------------------------------------------------------------------

template <int QT>
float dot_row_scalar(const uint8_t* w, const QAct& a, int64_t t) {
  const int8_t* xq = a.q + t * a.k;
  const float* xd = a.d + t * a.nb;
  const float* xs = a.s + t * a.nb;
  float acc = 0.0f;
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = w + b * kBlockBytes[QT];
    const int8_t* x = xq + b * kBlock;
    int32_t dot = 0;
    if constexpr (QT == kQ8_0) {
      const int8_t* qw = reinterpret_cast<const int8_t*>(blk + 2);
      for (int i = 0; i < kBlock; ++i) dot += static_cast<int32_t>(qw[i]) * x[i];
      acc += load_half(blk) * xd[b] * static_cast<float>(dot);
    } else {
      const uint8_t* qs = blk + (QT == kQ4_0 ? 2 : 4);
      for (int i = 0; i < 16; ++i) {
        dot += static_cast<int32_t>(qs[i] & 0x0F) * x[i];
        dot += static_cast<int32_t>(qs[i] >> 4) * x[i + 16];
      }
      const float dw = load_half(blk);
      const float mw = QT == kQ4_0 ? -8.0f * dw : load_half(blk + 2);
      acc += dw * xd[b] * static_cast<float>(dot) + mw * xs[b];
    }
  }
  return acc;
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


// ---- layout x16 ---------------------------------------------------------------------------

constexpr int kGroup = 16;

// Offset of a group-block's values (after the 16 d and, for q4_1, the 16 m).
constexpr int64_t x16_values_offset(int qtype) { return qtype == kQ4_1 ? 64 : 32; }

// Block b of output row `row` in the GGUF byte layout: a pointer into w for a plain row (at or
// past `grouped`), else rebuilt into tmp from its group.
const uint8_t* x16_plain_block(const uint8_t* w, int64_t row_bytes, int qtype, int64_t grouped,
                               int64_t row, int64_t b, uint8_t* tmp) {
  const int64_t bb = kBlockBytes[qtype];
  if (row >= grouped) return w + row * row_bytes + b * bb;
  const int64_t g = row / kGroup, i = row % kGroup;
  const uint8_t* blk = w + g * kGroup * row_bytes + b * kGroup * bb;
  std::memcpy(tmp, blk + 2 * i, 2);
  if (qtype == kQ4_1) std::memcpy(tmp + 2, blk + 32 + 2 * i, 2);
  const uint8_t* vals = blk + x16_values_offset(qtype);
  const int chunks = qtype == kQ8_0 ? 8 : 4;
  uint8_t* out = tmp + (qtype == kQ4_1 ? 4 : 2);
  for (int c = 0; c < chunks; ++c) std::memcpy(out + 4 * c, vals + c * 64 + 4 * i, 4);
  return tmp;
}

template <int QT>
float dot_row_scalar_x16(const uint8_t* w, int64_t row_bytes, int64_t grouped, int64_t row,
                         const QAct& a, int64_t t) {
  uint8_t tmp[40];
  float acc = 0.0f;
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = x16_plain_block(w, row_bytes, QT, grouped, row, b, tmp);
    const QAct one{a.q + t * a.k + b * kBlock, a.d + t * a.nb + b, a.s + t * a.nb + b, kBlock, 1};
    acc += dot_row_scalar<QT>(blk, one, 0);
  }
  return acc;
}

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

// The x16 layout's rows (see the header): groups on the AVX-512 kernel or the scalar one,
// the plain tail rows on the scalar dot.
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

template <typename scalar_t>
void dequant_row(const uint8_t* wp, int64_t row_bytes, int64_t n, int layout, int64_t row,
                 int qtype, int64_t k, scalar_t* o);
void check_weight(const Tensor& weight, int64_t qtype, int64_t k);

// ---- amx_bf16_linear: the x16 weights dequantized to bf16 AMX tiles inside the GEMM ------
//
// out [M, N] = x [M, K] @ W^T in bf16, W read in the x16 layout and dequantized per group of
// 32 output columns into the tile layout of kvserve_amx_linear.cpp, then multiplied exactly
// as that kernel multiplies its packed copy (same tiles, same k order, fp32 accumulation, one
// RNE rounding to bf16). Each weight is dequantized as the dense copy is (d * q + m in fp32,
// rounded to bf16), so the output equals the `dequant_amx_bf16` copy's bit for bit.
// NOTE: why: from ~16 rows a step is compute bound in the int8-dot kernels and the dense
// bf16 copy won, streaming 3.6x the bytes of the Q4_1 weights and holding a second copy of
// every one; dequantizing inside the GEMM costs the same work for any M, once per call.
#if defined(KVQ_HAVE_AMX)
#define KVQ_AMXBF16                                                                      \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16," \
                        "fma,f16c")))

// Lane r: byte J of lane r of `wv` as a float: q8_0's signed value, or a nibble format's low
// nibble (HIGH: its high nibble).
// NOTE: int to float through the float bits of 2^23 + q (an add or an OR, then a subtraction,
// both exact) instead of vcvtdq2ps, which shares its port with the shifts: a layer's Q4_1
// projections at M = 32 took 224-237 us against 243-256 (bench/results/session21/magic_ab.txt).
template <int QT, int J, bool HIGH>
KVQ_AMXBF16 inline __m512 lane_value(__m512i wv) {
  if constexpr (QT == kQ8_0) {
    // 2^23 + 2^22 + q as float bits, minus 2^23 + 2^22: q exactly (|q| < 2^22).
    const __m512i q = _mm512_srai_epi32(_mm512_slli_epi32(wv, 24 - 8 * J), 24);
    const __m512i b = _mm512_add_epi32(q, _mm512_set1_epi32(0x4B400000));
    return _mm512_sub_ps(_mm512_castsi512_ps(b), _mm512_set1_ps(12582912.0f));
  } else {
    // (x & 15) | bits of 2^23 in one ternary-logic op: the float 2^23 + q, minus 2^23: q.
    const __m512i s = _mm512_srli_epi32(wv, 8 * J + (HIGH ? 4 : 0));
    const __m512i b = _mm512_ternarylogic_epi32(s, _mm512_set1_epi32(0x0F),
                                                _mm512_set1_epi32(0x4B000000), 0xEA);
    return _mm512_sub_ps(_mm512_castsi512_ps(b), _mm512_set1_ps(8388608.0f));
  }
}

// The weights of 16 rows: d * q (q8_0) or d * q + m (m = -8 d for q4_0, exact), in float.
template <int QT>
KVQ_AMXBF16 inline __m512 scaled(__m512 q, __m512 d, __m512 m) {
  return QT == kQ8_0 ? _mm512_mul_ps(q, d) : _mm512_fmadd_ps(q, d, m);
}

// One B tile row: 16 rows' weights k (w0, lane r = row r) and k + 1 (w1) as bf16 pairs.
KVQ_AMXBF16 inline void store_pairs(__m512 w0, __m512 w1, uint16_t* row) {
  const __m512i words = (__m512i)_mm512_cvtne2ps_pbh(w1, w0);  // [w0's 16 | w1's 16] (RNE)
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  _mm512_storeu_si512(row, _mm512_permutexvar_epi16(pairs, words));
}

// One 64-byte chunk (int32 lane r = 4 value bytes of row r) -> tile rows kp (the bytes' values
// 0 and 1) and kp + 1 (2 and 3); nibble formats: the low nibbles, or with HIGH the high ones.
// NOTE: lane r stays row r from the load to the store, so each step is one instruction per 16
// rows, the scales need no shuffling, and one word permute pairs two rows of values. Before
// session 21 each 16 bytes were widened to 4 values of 4 rows per vector (an extract and a
// vpmovzx each, the scales shuffled to match, two 2-source permutes per tile row pair): about
// twice the shuffle-port work, and the dequantization is what bounds this kernel at decode
// sizes: its cost is per call, and M = 16 took 80-90 % of M = 32's time.
template <int QT, bool HIGH>
KVQ_AMXBF16 inline void chunk_to_tile(__m512i wv, __m512 d, __m512 m, uint16_t* tile, int kp) {
  store_pairs(scaled<QT>(lane_value<QT, 0, HIGH>(wv), d, m),
              scaled<QT>(lane_value<QT, 1, HIGH>(wv), d, m), tile + kp * 32);
  store_pairs(scaled<QT>(lane_value<QT, 2, HIGH>(wv), d, m),
              scaled<QT>(lane_value<QT, 3, HIGH>(wv), d, m), tile + (kp + 1) * 32);
}

// One x16 group-block (16 rows x 32 values) -> a B tile [16 kp][16 rows][2] bf16.
template <int QT>
KVQ_AMXBF16 void dequant_btile(const uint8_t* blk, uint16_t* tile) {
  constexpr int64_t VO = x16_values_offset(QT);
  // Lane r: row r's d and m.
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
  __m512 m = _mm512_setzero_ps();
  if constexpr (QT == kQ4_1)
    m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
  if constexpr (QT == kQ4_0) m = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));  // d (q - 8), exact
  const uint8_t* v = blk + VO;
  if constexpr (QT == kQ8_0) {
    for (int c = 0; c < 8; ++c)
      chunk_to_tile<QT, false>(_mm512_loadu_si512(v + 64 * c), d, m, tile, 2 * c);
  } else {
    for (int c = 0; c < 4; ++c) {
      const __m512i wv = _mm512_loadu_si512(v + 64 * c);
      chunk_to_tile<QT, false>(wv, d, m, tile, 2 * c);
      chunk_to_tile<QT, true>(wv, d, m, tile, 8 + 2 * c);
    }
  }
}

// Column group G (outputs 32G .. 32G + 31) for all k blocks -> bt [kblocks][2][16][32] bf16
// (kvserve_amx_linear.cpp's packed layout); rows past N are zeros, plain tail rows take the
// scalar dequantization.
template <int QT>
KVQ_AMXBF16 void dequant_group(const uint8_t* wp, int64_t row_bytes, int64_t n, int64_t k,
                               int64_t G, uint16_t* bt, std::vector<float>& row_buf) {
  constexpr int64_t GB = kGroup * kBlockBytes[QT];
  const int64_t kblocks = k / kBlock, grouped = n / kGroup * kGroup;
  for (int h = 0; h < 2; ++h) {
    const int64_t r0 = G * 32 + h * 16;
    if (r0 + 16 <= grouped) {
      const uint8_t* g = wp + r0 * row_bytes;
      for (int64_t kb = 0; kb < kblocks; ++kb)
        dequant_btile<QT>(g + kb * GB, bt + kb * 1024 + h * 512);
      continue;
    }
    for (int64_t kb = 0; kb < kblocks; ++kb)
      std::fill(bt + kb * 1024 + h * 512, bt + kb * 1024 + h * 512 + 512, uint16_t{0});
    row_buf.resize(static_cast<size_t>(k));
    for (int c = 0; c < 16 && r0 + c < n; ++c) {
      dequant_row<float>(wp, row_bytes, n, kGroup, r0 + c, QT, k, row_buf.data());
      for (int64_t kk = 0; kk < k; ++kk) {
        const c10::BFloat16 b(row_buf[kk]);  // RNE, as the dense copy's .to(bfloat16)
        bt[(kk / 32) * 1024 + h * 512 + (kk % 32 / 2) * 32 + 2 * c + kk % 2] = b.x;
      }
    }
  }
}

template <int QT>
KVQ_AMXBF16 void run_amx_bf16(const uint16_t* xs, int64_t ldx, int64_t m, int64_t k,
                              const uint8_t* wp, int64_t row_bytes, int64_t n, uint16_t* o,
                              int64_t ldo) {
  const int64_t mpad = (m + 15) / 16 * 16, kblocks = k / kBlock;
  // NOTE: as kvserve_amx_linear.cpp: whole 16-row blocks read in place when 64-byte aligned,
  // the rest copied zero-padded, so no tile row straddles two cache lines.
  const bool aligned = reinterpret_cast<uintptr_t>(xs) % 64 == 0 && ldx % 32 == 0;
  const int64_t full = aligned ? m / 16 * 16 : 0;
  thread_local std::vector<uint16_t> padded;
  uint16_t* tail = nullptr;
  if (full < mpad) {
    padded.resize((mpad - full) * k + 32);
    tail = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(padded.data()) + 63) &
                                       ~uintptr_t(63));
    std::fill(tail, tail + (mpad - full) * k, uint16_t(0));
    for (int64_t r = full; r < m; ++r) std::memcpy(tail + (r - full) * k, xs + r * ldx, k * 2);
  }
  auto block_rows = [&](int64_t r, int64_t& ld) -> const uint16_t* {
    ld = r < full ? ldx : k;
    return r < full ? xs + r * ldx : tail + (r - full) * k;
  };
  const int64_t groups = (n + 31) / 32;
  constexpr int64_t GB = kGroup * kBlockBytes[QT];
  const int64_t grouped = n / kGroup * kGroup;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    thread_local std::vector<uint16_t> bt_buf;
    thread_local std::vector<float> row_buf;
    const int64_t bt_elems = kblocks * 1024 + 32;
    bt_buf.resize(static_cast<size_t>(2 * bt_elems));
    uint16_t* bts[2];
    for (int b = 0; b < 2; ++b)
      bts[b] = reinterpret_cast<uint16_t*>(
          (reinterpret_cast<uintptr_t>(bt_buf.data() + b * bt_elems) + 63) & ~uintptr_t(63));
    kvserve::load_tile_config();
    alignas(64) float cbuf[32 * 32];
    // NOTE: software pipelined: group G + 1's tiles are dequantized (vector ALU work) between
    // group G's tile products (AMX work), one k block at a time, so that the two overlap in
    // the out-of-order window instead of taking turns, and group G + 2's bytes are prefetched
    // into L2 meanwhile (a decode step's weights come from DRAM: the K/V it read evicted
    // them). Whole 32-row groups only; a group with plain tail rows is dequantized on its own.
    // Measured on the AMX Xeon (session 21, two threads, bench/probes/amx_quant_layer.py, a
    // layer's four projections in turn over 30 layers' weights): 289-318 -> 222-235 us at
    // M = 32, 255-276 -> 184-212 at M = 16, with the one-row-per-lane dequantization above.
    // The prefetch took the bare runner's B=32 decode step from 27.3-27.6 to 25.1-26.1 ms
    // (bench/results/session21/weight_prefetch.txt).
    dequant_group<QT>(wp, row_bytes, n, k, g0, bts[0], row_buf);
    for (int64_t G = g0; G < g1; ++G) {
      uint16_t* bt = bts[(G - g0) % 2];
      uint16_t* next = bts[(G - g0 + 1) % 2];
      const bool has_next = G + 1 < g1;
      const bool pipe = has_next && (G + 1) * 32 + 32 <= grouped;
      const uint8_t* next_w = pipe ? wp + (G + 1) * 32 * row_bytes : wp;
      // The group after next, prefetched into L2 over this group's k blocks (its bytes may run
      // past the weight's last row: a prefetch never faults).
      const bool pf_next = G + 2 < g1;
      const char* pf = reinterpret_cast<const char*>(pf_next ? wp + (G + 2) * 32 * row_bytes : wp);
      const int64_t pf_end = pf_next ? 32 * row_bytes : 0;
      const int64_t pf_step = (32 * row_bytes / kblocks + 63) / 64 * 64;
      const int64_t cols = std::min<int64_t>(32, n - G * 32);
      const __mmask32 keep = cols == 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
      for (int64_t r0 = 0; r0 < mpad; r0 += 32) {
        const bool two = mpad - r0 >= 32;
        int64_t ld0 = 0, ld1 = 0;
        const uint16_t* x0 = block_rows(r0, ld0);
        const uint16_t* x1 = two ? block_rows(r0 + 16, ld1) : x0;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < kblocks; ++kb) {
          if (pipe && r0 == 0) {
            for (int64_t b = kb * pf_step; b < std::min(pf_end, (kb + 1) * pf_step); b += 64)
              _mm_prefetch(pf + b, _MM_HINT_T1);
            dequant_btile<QT>(next_w + kb * GB, next + kb * 1024);
            dequant_btile<QT>(next_w + 16 * row_bytes + kb * GB, next + kb * 1024 + 512);
          }
          const uint16_t* b = bt + kb * 1024;
          _tile_loadd(6, b, 64);
          _tile_loadd(7, b + 512, 64);
          _tile_loadd(4, x0 + kb * 32, ld0 * 2);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (two) {
            _tile_loadd(5, x1 + kb * 32, ld1 * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, cbuf, 128);
        _tile_stored(1, cbuf + 16, 128);
        if (two) {
          _tile_stored(2, cbuf + 16 * 32, 128);
          _tile_stored(3, cbuf + 16 * 32 + 16, 128);
        }
        kvserve::store_rows_bf16(cbuf, std::min<int64_t>(32, m - r0), o + r0 * ldo + G * 32, ldo,
                                 keep);
      }
      if (has_next && !pipe) dequant_group<QT>(wp, row_bytes, n, k, G + 1, next, row_buf);
    }
    _tile_release();
  });
}
#endif  // KVQ_HAVE_AMX

bool amx_bf16_ready() {
#if defined(KVQ_HAVE_AMX)
  return amx_tiles_ready() && isa_supported(kIsaAvx512Vnni);
#else
  return false;
#endif
}

// out [M, N] (bf16, rows contiguous, any row stride) = x [M, K] (bf16) @ dequant(weight)^T,
// weight in the x16 layout.
void quant_amx_bf16_linear(Tensor out, const Tensor& x, const Tensor& weight, int64_t qtype) {
  TORCH_CHECK(amx_bf16_ready(), "kvserve_quant: amx_bf16_linear needs AMX-BF16 (this build or "
              "CPU has none, or the kernel refused the tile state)");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  x.scalar_type() == at::kBFloat16,
              "kvserve_quant: amx_bf16_linear takes a 2-D bfloat16 CPU x with contiguous rows");
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.stride(1) == 1 &&
                  out.scalar_type() == at::kBFloat16,
              "kvserve_quant: amx_bf16_linear writes a 2-D bfloat16 CPU out with contiguous rows");
  check_weight(weight, qtype, x.size(1));
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == weight.size(0),
              "kvserve_quant: out must be [", x.size(0), ", ", weight.size(0), "], got ",
              out.sizes());
  if (x.size(0) == 0) return;
#if defined(KVQ_HAVE_AMX)
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0), rb = weight.size(1);
  if (qtype == kQ8_0) run_amx_bf16<kQ8_0>(xs, x.stride(0), m, k, wp, rb, n, o, out.stride(0));
  if (qtype == kQ4_0) run_amx_bf16<kQ4_0>(xs, x.stride(0), m, k, wp, rb, n, o, out.stride(0));
  if (qtype == kQ4_1) run_amx_bf16<kQ4_1>(xs, x.stride(0), m, k, wp, rb, n, o, out.stride(0));
#endif
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

void check_weight(const Tensor& weight, int64_t qtype, int64_t k) {
  TORCH_CHECK(qtype >= 0 && qtype <= 2, "kvserve_quant: unknown qtype code ", qtype);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.dim() == 2 &&
                  weight.is_contiguous(),
              "kvserve_quant: weight must be a contiguous CPU uint8 [N, row_bytes] tensor");
  TORCH_CHECK(k % kBlock == 0, "kvserve_quant: in_features ", k, " is not a multiple of 32");
  TORCH_CHECK(weight.size(1) == k / kBlock * kBlockBytes[qtype], "kvserve_quant: weight rows have ",
              weight.size(1), " bytes, expected ", k / kBlock * kBlockBytes[qtype], " for ", k,
              " inputs");
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
  if (x.size(0) == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quant_linear", [&] {
    run_linear<scalar_t>(x, weight, static_cast<int>(qtype), bp, out, chosen,
                         static_cast<int>(layout));
  });
}

// Output row `row` of a weight in `layout` (0 or 16) dequantized into o [k].
template <typename scalar_t>
void dequant_row(const uint8_t* wp, int64_t row_bytes, int64_t n, int layout, int64_t row,
                 int qtype, int64_t k, scalar_t* o) {
  const int64_t grouped = layout == kGroup ? n / kGroup * kGroup : 0;
  uint8_t tmp[40];
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const uint8_t* blk = x16_plain_block(wp, row_bytes, qtype, grouped, row, b, tmp);
    const float d = load_half(blk);
    scalar_t* ob = o + b * kBlock;
    if (qtype == kQ8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
      for (int i = 0; i < kBlock; ++i) ob[i] = static_cast<scalar_t>(d * q[i]);
    } else {
      const uint8_t* qs = blk + (qtype == kQ4_0 ? 2 : 4);
      const float mn = qtype == kQ4_0 ? -8.0f * d : load_half(blk + 2);
      for (int i = 0; i < 16; ++i) {
        // NOTE: d * q + m with m = -8 d for q4_0 equals d * (q - 8) exactly (q - 8 is small).
        ob[i] = static_cast<scalar_t>(qtype == kQ4_0 ? d * ((qs[i] & 0x0F) - 8)
                                                     : d * (qs[i] & 0x0F) + mn);
        ob[i + 16] = static_cast<scalar_t>(qtype == kQ4_0 ? d * ((qs[i] >> 4) - 8)
                                                          : d * (qs[i] >> 4) + mn);
      }
    }
  }
}

// out [T, K] = dequant(weight)[ids]: the embedding lookup of a quantized table.
void quant_embedding(Tensor out, const Tensor& ids, const Tensor& weight, int64_t qtype,
                     int64_t layout) {
  TORCH_CHECK(layout == 0 || layout == kGroup, "kvserve_quant: unknown layout code ", layout);
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.stride(1) == 1,
              "kvserve_quant: out must be a 2-D CPU tensor with contiguous rows");
  check_weight(weight, qtype, out.size(1));
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.size(0) == out.size(0),
              "kvserve_quant: ids must be int64 [T] with T = out.size(0)");
  const Tensor idc = ids.contiguous();
  const int64_t* ip = idc.data_ptr<int64_t>();
  const int64_t t_n = out.size(0), k = out.size(1), rows = weight.size(0);
  for (int64_t t = 0; t < t_n; ++t)
    TORCH_CHECK(ip[t] >= 0 && ip[t] < rows, "kvserve_quant: token id ", ip[t], " out of range");
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const int64_t row_bytes = weight.size(1), stride = out.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "quant_embedding",
                                  [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, t_n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        dequant_row<scalar_t>(wp, row_bytes, rows, static_cast<int>(layout), ip[t],
                              static_cast<int>(qtype), k, op + t * stride);
    });
  });
}

bool quant_isa_supported(int64_t isa) { return isa_supported(static_cast<int>(isa)); }

bool quant_amx_bf16_supported() { return amx_bf16_ready(); }

int64_t quant_best_isa() { return best_isa(); }

}  // namespace
}  // namespace kvserve_quant

TORCH_LIBRARY(kvserve_quant, m) {
  m.def(
      "linear(Tensor(a!) out, Tensor x, Tensor weight, int qtype, Tensor? bias, int isa, "
      "int layout=0) -> ()");
  m.def("embedding(Tensor(a!) out, Tensor ids, Tensor weight, int qtype, int layout=0) -> ()");
  m.def("amx_bf16_linear(Tensor(a!) out, Tensor x, Tensor weight, int qtype) -> ()");
  m.def("amx_bf16_supported() -> bool", &kvserve_quant::quant_amx_bf16_supported);
  m.def("isa_supported(int isa) -> bool", &kvserve_quant::quant_isa_supported);
  m.def("best_isa() -> int", &kvserve_quant::quant_best_isa);
}

TORCH_LIBRARY_IMPL(kvserve_quant, CPU, m) {
  m.impl("linear", &kvserve_quant::quant_linear);
  m.impl("embedding", &kvserve_quant::quant_embedding);
  m.impl("amx_bf16_linear", &kvserve_quant::quant_amx_bf16_linear);
}
