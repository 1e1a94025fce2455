// kvserve native AMX int8 linear: y = x @ W^T with W held as int8 in blocks of 64 inputs
// (a scale per output column and block) and x quantized on the fly the same way (a scale per
// row and block), multiplied on Intel AMX int8 tiles (TDPBSSD).
//
// Part of the `kvserve` op library (registered in bindings.cpp). Ops:
//   amx_int8_supported() -> bool            compiled with AMX-INT8 and the tile state granted
//   amx_int8_linear(out, x, packed) -> ()   out [M, N] = x [M, K] @ W^T, x and out bf16, W
//                                           packed by kvserve/runtime/amx_int8.py
//                                           (``pack_int8_weight``)
//
// Packed layout: int8 [ceil(N/32), ceil(K/64) * 2176]: per group g of 32 output columns, for
// each block kb of 64 inputs, two B tiles (columns g*32 + nb*16 + c, nb = 0, 1), each 16 rows
// of quads: byte [kq][4c + j] = q[g*32 + nb*16 + c][kb*64 + 4kq + j] (the pairing TDPBSSD
// reads), then the block's 32 column scales as fp32 (W ~ scale * q, q in [-127, 127]).
// Padded columns and inputs are zeros. A group's bytes lie one after another, so a call
// streams the weight once, front to back, scales included.
//
// Each row of x is quantized per block of 64 inputs as x ~ s_x * q_x, s_x = max|x| / 127,
// q_x = round(x * (127 / max|x|)) in fp32, to nearest even. A block's integer dot products
// are exact (int32); each is scaled by s_x s_w and summed in fp32, and each output is rounded
// to bf16 once.
//
// NOTE: why blocks of 64. One scale per row of x over all of K (per-token int8, as W8A8 schemes
// use) cost the embedded model 2.8 % perplexity in `kvserve bench accuracy`, simulated (its
// activations have outlier channels); blocks of 64 on both sides left it within the run's noise
// of fp32 (bench/ACCURACY.md; the AMX Xeon, 2026-12-06, 29406c0). A block is one tile product,
// so the scaling is vector work per block and output, ~6 instructions per 16 outputs; the
// kernel it competes with dequantizes every weight to bf16 per call instead.
//
// NOTE: why at all. At decode sizes (16-64 rows) the Q4_1 kernel on AMX bf16 tiles
// (quant/quant_amx_bf16.cpp, amx_bf16_linear) is bound by dequantizing the blocks to bf16 in
// vector registers, work done per call whatever M is (on the AMX Xeon, 2026-12-05, 6-7 ms of
// a 17.8 ms B=32 step). Here the weight goes from memory into the tiles as it is held: the
// call costs the weight's bytes (1.06 per weight, 1.7x Q4_1's 0.625) over the memory
// bandwidth. The price: a second copy of each weight it serves, held beside the blocks. The
// kernel selection takes it only where it measures faster (kvserve/runtime/autotune/).
//
// Blocking as amx_linear.cpp: per group, rows in pairs of 16-row blocks: C tiles 0-3
// (2 row blocks x 2 column blocks, int32), A tiles 4-5 (quantized x rows), B tiles 6-7; the
// fp32 sums of a row pair's 32 x 32 outputs stay in an L1 buffer across the k blocks.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__)
#define KVSERVE_AMX_INT8 1
#include <immintrin.h>

#include "arch/amx_tiles.h"
#endif

#include "ops.h"

namespace kvserve {
namespace {

using at::Tensor;

constexpr int64_t kKBlock = 64;                        // inputs per block (one tile row)
constexpr int64_t kTileBytes = 16 * 64;                // one B tile
constexpr int64_t kBlockBytes = 2 * kTileBytes + 128;  // two B tiles and 32 fp32 scales

#if defined(KVSERVE_AMX_INT8)
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of the tile loads to prefetch

// 16 bf16 values -> fp32 (bf16 is the top half of an fp32); lanes off `mask` are zeros.
inline __m512 load_bf16(const uint16_t* p, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The lanes of 16 that hold one of `left` values still to read.
inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
}

// Row x [k] (bf16) -> q [kpad] int8 (zeros past k) and a scale per block of 64, s [kpad / 64].
// NOTE: a NaN or an infinity in a block gives it a NaN scale (and zeros), so the outputs are
// NaN and the step's guard sees them as it would from any other kernel; vmaxps drops a NaN
// operand, so NaNs are tracked apart.
inline void quantize_row(const uint16_t* x, int64_t k, int64_t kpad, int8_t* q, float* s) {
  for (int64_t b = 0; b < kpad; b += kKBlock) {
    __m512 v[4];
    __m512 amax = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int i = 0; i < 4; ++i) {
      v[i] = load_bf16(x + b + 16 * i, lanes(k - b - 16 * i));
      bad |= _mm512_cmp_ps_mask(v[i], v[i], _CMP_UNORD_Q);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
    }
    const float mx = _mm512_reduce_max_ps(amax);
    if (bad != 0 || !std::isfinite(mx) || mx == 0.0f) {
      std::memset(q + b, 0, kKBlock);
      s[b / kKBlock] = mx == 0.0f && bad == 0 ? 0.0f : std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const __m512 inv = _mm512_set1_ps(127.0f / mx);
    for (int i = 0; i < 4; ++i) {
      const __m512i r = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v[i], inv),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b + 16 * i), _mm512_cvtsepi32_epi8(r));
    }
    s[b / kKBlock] = mx / 127.0f;
  }
}

// Block kb's sums c [32 rows][32 cols] int32 scaled by x's and W's block scales (sa [rows]
// [kblocks], sw [32]) into acc [32 rows][32 cols] fp32 (the first block sets it).
inline void scale_block(const int32_t* c, const float* sa, int64_t rows, int64_t kblocks,
                        int64_t kb, const float* sw, float* acc) {
  const __m512 sw_lo = _mm512_loadu_ps(sw), sw_hi = _mm512_loadu_ps(sw + 16);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 s = _mm512_set1_ps(sa[r * kblocks + kb]);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_load_si512(c + r * 32));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_load_si512(c + r * 32 + 16));
    float* o = acc + r * 32;
    if (kb == 0) {
      _mm512_store_ps(o, _mm512_mul_ps(lo, _mm512_mul_ps(sw_lo, s)));
      _mm512_store_ps(o + 16, _mm512_mul_ps(hi, _mm512_mul_ps(sw_hi, s)));
    } else {
      _mm512_store_ps(o, _mm512_fmadd_ps(lo, _mm512_mul_ps(sw_lo, s), _mm512_load_ps(o)));
      _mm512_store_ps(o + 16,
                      _mm512_fmadd_ps(hi, _mm512_mul_ps(sw_hi, s), _mm512_load_ps(o + 16)));
    }
  }
}

// One 32-column group times `rows` (1-32) rows of quantized x (16 * BLOCKS rows, padded; row
// stride kpad bytes; scales sa [rows][kblocks]) -> acc [32 rows][32 cols] fp32. Each k block
// prefetches `pf_lines` cache lines from `pf` on (into L2 with `pf_to_l2`, else L1), as
// amx_linear.cpp's group_tiles does.
// NOTE: software pipelined: block kb's tile products are issued, then block kb - 1's sums
// (stored by the previous step, in the other of two buffers) are scaled while they run, then
// kb's are stored. Scaling a block's sums right after storing them left the AMX unit idle
// meanwhile; storing every block's sums first and then summing 8 rows at a time in registers
// was slower still (1.1-1.3x at M = 1-128: no overlap, and at K = 1536 the sums spill to L2).
template <int BLOCKS>
void group_rows(const int8_t* a, const float* sa, int64_t rows, int64_t kpad, const int8_t* w,
                float* acc, int32_t* cbuf, const char* pf, int pf_lines, bool pf_to_l2) {
  const int64_t kblocks = kpad / kKBlock;
  for (int64_t kb = 0; kb <= kblocks; ++kb) {
    const int8_t* b = w + kb * kBlockBytes;  // the two B tiles and the scales of this block
    int32_t* c = cbuf + (kb % 2) * 32 * 32;
    if (kb < kblocks) {
      const char* ahead = pf + kb * pf_lines * 64;
      for (int line = 0; line < pf_lines; ++line) {
        if (pf_to_l2)
          _mm_prefetch(ahead + line * 64, _MM_HINT_T1);
        else
          _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
      }
      _tile_zero(0);
      _tile_zero(1);
      _tile_loadd(6, b, 64);
      _tile_loadd(7, b + kTileBytes, 64);
      _tile_loadd(4, a + kb * kKBlock, kpad);
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      if (BLOCKS == 2) {
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(5, a + 16 * kpad + kb * kKBlock, kpad);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
      }
    }
    if (kb > 0) {
      const int8_t* prev = b - kBlockBytes;
      scale_block(cbuf + ((kb - 1) % 2) * 32 * 32, sa, rows, kblocks, kb - 1,
                  reinterpret_cast<const float*>(prev + 2 * kTileBytes), acc);
    }
    if (kb < kblocks) {
      _tile_stored(0, c, 128);
      _tile_stored(1, c + 16, 128);
      if (BLOCKS == 2) {
        _tile_stored(2, c + 16 * 32, 128);
        _tile_stored(3, c + 16 * 32 + 16, 128);
      }
    }
  }
}
#endif  // KVSERVE_AMX_INT8

}  // namespace

bool amx_int8_supported() {
#if defined(KVSERVE_AMX_INT8)
  return amx_tiles_granted();
#else
  return false;
#endif
}

void amx_int8_linear(Tensor out, const Tensor& x, const Tensor& packed) {
  TORCH_CHECK(amx_int8_supported(), "amx_int8_linear: this build or CPU has no AMX-INT8");
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu() && packed.device().is_cpu(),
              "amx_int8_linear: tensors must be on CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "amx_int8_linear: x and out must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1,
              "amx_int8_linear: x and out must be 2-D with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  const int64_t kpad = (k + kKBlock - 1) / kKBlock * kKBlock, kblocks = kpad / kKBlock;
  const int64_t groups = (n + 31) / 32;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(0) == groups && packed.size(1) == kblocks * kBlockBytes,
              "amx_int8_linear: packed must be a contiguous int8 [", groups, ", ",
              kblocks * kBlockBytes, "] tensor for N = ", n, ", K = ", k, ", got ",
              packed.sizes());
  TORCH_CHECK(out.size(0) == m, "amx_int8_linear: out has ", out.size(0), " rows, x has ", m);
  if (m == 0) return;
#if defined(KVSERVE_AMX_INT8)
  const int64_t mpad = (m + 15) / 16 * 16;
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const int64_t ldx = x.stride(0);
  // The quantized rows [mpad, kpad] (zero-padded; 64-byte aligned, so that no tile row
  // straddles two cache lines) and their block scales [mpad, kblocks].
  thread_local std::vector<int8_t> qbuf;
  thread_local std::vector<float> sbuf;
  qbuf.resize(static_cast<size_t>(mpad * kpad + 64));
  sbuf.resize(static_cast<size_t>(mpad * kblocks));
  int8_t* qa = reinterpret_cast<int8_t*>(
      (reinterpret_cast<uintptr_t>(qbuf.data()) + 63) & ~uintptr_t(63));
  float* sa = sbuf.data();
  std::memset(qa + m * kpad, 0, static_cast<size_t>((mpad - m) * kpad));
  std::fill(sa + m * kblocks, sa + mpad * kblocks, 0.0f);
  at::parallel_for(0, m, std::max<int64_t>(1, 8192 / kpad), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      quantize_row(xs + r * ldx, k, kpad, qa + r * kpad, sa + r * kblocks);
  });
  const int8_t* w = packed.data_ptr<int8_t>();
  const int64_t gbytes = packed.size(1);
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t ldo = out.stride(0);
  const int64_t pairs = (mpad + 31) / 32;
  constexpr int kLines = kBlockBytes / 64;                          // lines per k block
  const int pf_share = static_cast<int>((kLines + pairs - 1) / pairs);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    load_tile_config();
    alignas(64) int32_t cbuf[2 * 32 * 32];
    alignas(64) float acc[32 * 32];
    for (int64_t g = g0; g < g1; ++g) {
      const int8_t* wg = w + g * gbytes;
      const int64_t cols = std::min<int64_t>(32, n - g * 32);
      const __mmask32 keep = cols == 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
      for (int64_t r0 = 0; r0 < mpad; r0 += 32) {
        // NOTE: which lines to prefetch: as amx_linear.cpp (one row pair: this
        // group's own bytes 4 KiB ahead into L1; several: each pair its share of the next
        // group's into L2, since the later pairs read this group from the caches).
        const bool to_l2 = pairs > 1;
        const int lines = to_l2 ? pf_share : kLines;
        const char* pf = reinterpret_cast<const char*>(wg) + kPrefetchBytes;
        if (to_l2)
          pf = reinterpret_cast<const char*>(wg + gbytes) + (r0 / 32) * kblocks * lines * 64;
        const int64_t rows = std::min<int64_t>(32, m - r0);
        const int8_t* a = qa + r0 * kpad;
        const float* s = sa + r0 * kblocks;
        if (mpad - r0 >= 32)
          group_rows<2>(a, s, rows, kpad, wg, acc, cbuf, pf, lines, to_l2);
        else
          group_rows<1>(a, s, rows, kpad, wg, acc, cbuf, pf, lines, to_l2);
        store_rows_bf16(acc, rows, o + r0 * ldo + g * 32, ldo, keep);
      }
    }
    _tile_release();
  });
#endif
}

}  // namespace kvserve
