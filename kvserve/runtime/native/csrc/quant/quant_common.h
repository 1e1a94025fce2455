// What the files of the `kvserve_quant` library share: the GGML block formats' constants, the
// instruction-set choice (target_has caps it to a named build target's, cpu_has asks the CPU),
// fp16 loads, the quantized activations (QAct), the x16 layout's block addressing and the
// scalar block dot and dequantization every path falls back to. README.md: the formats, the
// x16 layout and the numerics.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVQ_HAVE_AMX 1
#include "../arch/amx_tiles.h"  // the tile state request and configuration (shared)
#endif

namespace kvserve_quant {

using at::Tensor;

constexpr int kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2;
constexpr int64_t kBlock = 32;
constexpr int64_t kBlockBytes[3] = {34, 18, 20};
// The K-quants, held as stored (quant_kquant.h): super-blocks of 256 values.
constexpr int kQ4_K = 3, kQ5_K = 4, kQ6_K = 5;
constexpr int kNumQtypes = 6;
constexpr int64_t kSuper = 256;
constexpr int64_t kSuperBytes[3] = {144, 176, 210};  // block_q4_K, block_q5_K, block_q6_K

constexpr bool is_kquant(int qtype) { return qtype >= kQ4_K && qtype <= kQ6_K; }
// Values of one block of `qtype` (32, or 256 for a K-quant).
constexpr int64_t qtype_block(int qtype) { return is_kquant(qtype) ? kSuper : kBlock; }
// Bytes of one row of k values in `qtype`.
constexpr int64_t qtype_row_bytes(int qtype, int64_t k) {
  return is_kquant(qtype) ? k / kSuper * kSuperBytes[qtype - kQ4_K]
                          : k / kBlock * kBlockBytes[qtype];
}

constexpr int kIsaAuto = 0, kIsaScalar = 1, kIsaAvx2 = 2, kIsaAvxVnni = 3, kIsaAvx512Vnni = 4;

#define KVQ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define KVQ_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KVQ_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

// Whether this build has the AMX kernel and the kernel granted this process the tile state.
inline bool amx_tiles_ready() {
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

inline bool cpu_has(int isa) {
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

inline bool isa_supported(int isa) { return cpu_has(isa) && target_has(isa); }

inline int best_isa() {
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

// Quantized activations of M tokens: row m at q + m * k, d / s + m * nb.
struct QAct {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t k;
  int64_t nb;
};

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

constexpr int kGroup = 16;

// Offset of a group-block's values (after the 16 d and, for q4_1, the 16 m).
constexpr int64_t x16_values_offset(int qtype) { return qtype == kQ4_1 ? 64 : 32; }

// Block b of output row `row` in the GGUF byte layout: a pointer into w for a plain row (at or
// past `grouped`), else rebuilt into tmp from its group.
inline const uint8_t* x16_plain_block(const uint8_t* w, int64_t row_bytes, int qtype, int64_t grouped,
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

// quant_q4_k.cpp, quant_q5_k.cpp, quant_q6_k.cpp: one K-quant row dequantized into o [k]
// (fp32, the gguf package's arithmetic), and a tile of `rows` weight rows x `tokens` tokens
// (res [rows][tokens], rows <= 4, tokens <= 4) on `isa` (any isa above scalar runs AVX2).
void q4_k_dequant(const uint8_t* row, int64_t k, float* o);
void q5_k_dequant(const uint8_t* row, int64_t k, float* o);
void q6_k_dequant(const uint8_t* row, int64_t k, float* o);
void q4_k_tile(const uint8_t* w, int64_t row_bytes, int rows, const QAct& a, int64_t t0,
               int tokens, float* res, int isa);
void q5_k_tile(const uint8_t* w, int64_t row_bytes, int rows, const QAct& a, int64_t t0,
               int tokens, float* res, int isa);
void q6_k_tile(const uint8_t* w, int64_t row_bytes, int rows, const QAct& a, int64_t t0,
               int tokens, float* res, int isa);

// Output row `row` of a K-quant weight (plain layout) dequantized into o [k].
template <typename scalar_t>
void dequant_row_kquant(const uint8_t* wp, int64_t row_bytes, int64_t row, int qtype, int64_t k,
                        scalar_t* o) {
  const uint8_t* src = wp + row * row_bytes;
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (qtype == kQ4_K) return q4_k_dequant(src, k, o);
    if (qtype == kQ5_K) return q5_k_dequant(src, k, o);
    return q6_k_dequant(src, k, o);
  }
  float buf[kSuper];
  const int64_t sb = kSuperBytes[qtype - kQ4_K];
  for (int64_t s = 0; s < k / kSuper; ++s) {
    dequant_row_kquant<float>(src + s * sb, sb, 0, qtype, kSuper, buf);
    for (int64_t i = 0; i < kSuper; ++i) o[s * kSuper + i] = static_cast<scalar_t>(buf[i]);
  }
}

// Output row `row` of a weight in `layout` (0 or 16) dequantized into o [k].
template <typename scalar_t>
void dequant_row(const uint8_t* wp, int64_t row_bytes, int64_t n, int layout, int64_t row,
                 int qtype, int64_t k, scalar_t* o) {
  if (is_kquant(qtype)) return dequant_row_kquant<scalar_t>(wp, row_bytes, row, qtype, k, o);
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

// quant_linear.cpp
void check_weight(const Tensor& weight, int64_t qtype, int64_t k);
void quant_linear(Tensor out, const Tensor& x, const Tensor& weight, int64_t qtype,
                  const std::optional<Tensor>& bias, int64_t isa, int64_t layout);
// quant_linear_x16.cpp: the x16 layout's rows (float, double, Half and BFloat16 outputs).
template <typename scalar_t>
void run_linear_x16(const QAct& act, int64_t m, const uint8_t* wp, int64_t n, int64_t row_bytes,
                    int qtype, const float* bias, scalar_t* op, int64_t out_stride, int isa);
// quant_amx_bf16.cpp
bool amx_bf16_ready();
void quant_amx_bf16_linear(Tensor out, const Tensor& x, const Tensor& weight, int64_t qtype);
// quant_embedding.cpp
void quant_embedding(Tensor out, const Tensor& ids, const Tensor& weight, int64_t qtype,
                     int64_t layout);

}  // namespace kvserve_quant
