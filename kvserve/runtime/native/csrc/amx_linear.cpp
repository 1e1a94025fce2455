// kvserve native AMX linear: y = x @ W^T in bf16 on Intel AMX tiles.
//
// Part of the `kvserve` op library (registered in bindings.cpp). Ops:
//   amx_supported() -> bool          compiled with AMX-BF16 and the kernel granted the tile
//                                    state (arch_prctl ARCH_REQ_XCOMP_PERM) in this process
//   amx_linear(out, x, packed) -> () out [M, N] = x [M, K] @ W^T, bf16, W packed by
//                                    kvserve/runtime/amx_linear.py (``pack_weight``)
//
// Packed layout: [ceil(N/32), ceil(K/32), 2, 16, 32] bf16, W zero-padded to whole groups
// and blocks. For each group g of 32 output columns and each block kb of 32 inputs, two B
// tiles (columns g*32 + nb*16 + c, nb = 0, 1), each 16 rows of pairs: element [kp][2c + j]
// = W[g*32 + nb*16 + c][kb*32 + 2kp + j] (the VNNI pairing TDPBF16PS reads). A group's
// tiles lie one after another, so a call streams the weight once, front to back.
//
// NOTE: why: a decode or mixed step multiplies a few dozen rows by each weight, so the time is
// the weight's bytes over the memory bandwidth, and what matters is streaming the weight at
// full speed with little per-call overhead. On the AMX Xeon (2026-12-02, 7797456, cold weights,
// 2 threads, `kvserve bench kernels --dtype bfloat16`) oneDNN's bf16 linear (AMX too) and
// torch.mm read the embedded model's weights at 5.8-19 GB/s for M 1-32; this kernel, one pass
// per call and no primitive lookup, at 9.8-22 GB/s: 1.15-2.4x the better of the two per call at
// M 1-32, 1.0-1.7x at 128, 0.98-1.24x at 512. The kernel selection measures it against them per
// M bucket (kvserve/runtime/autotune/).
//
// Blocking: per group, rows in pairs of 16-row blocks: C tiles 0-3 (2 row blocks x 2
// column blocks, fp32), A tiles 4-5 (x rows, read from x in place), B tiles 6-7 (weight).
// Rows past M and inputs past K are padded with zeros (a copy of x's last partial 16-row
// block, or of all of x when K is not a multiple of 32); columns past N are computed and
// not stored.
// Accumulation is fp32 over all of K; each output is rounded to bf16 once (RNE).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVSERVE_AMX 1
#include <immintrin.h>

#include "arch/amx_tiles.h"
#endif

#include "ops.h"

namespace kvserve {
namespace {

using at::Tensor;

#if defined(KVSERVE_AMX)
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of the tile loads to prefetch

// Prefetch `n` cache lines from `p` on into the cache level HINT names (_MM_HINT_T0: L1,
// _MM_HINT_T1: L2). A prefetch never faults, so `p` may run past the weight's end.
template <int HINT>
inline void prefetch_lines(const char* p, int n) {
  for (int line = 0; line < n; ++line) _mm_prefetch(p + line * 64, static_cast<_mm_hint>(HINT));
}

// One 32-column group for a block of 16 * BLOCKS rows (BLOCKS 1 or 2) into cbuf [32 rows][32
// cols] fp32: rows 0-15 from x0 (row stride ld0 elements), rows 16-31 from x1 (ld1). Each k
// block prefetches `pf_lines` cache lines from `pf` on, into L2 with `pf_to_l2`, else into
// L1 (see amx_linear for which).
template <int BLOCKS>
void group_tiles(const uint16_t* x0, int64_t ld0, const uint16_t* x1, int64_t ld1, int64_t k,
                 const uint16_t* w, float* cbuf, const char* pf, int pf_lines, bool pf_to_l2) {
  _tile_zero(0);
  _tile_zero(1);
  if (BLOCKS == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < k / 32; ++kb) {
    const uint16_t* b = w + kb * 1024;  // the two 16x32 B tiles of this k block
    const char* ahead = pf + kb * pf_lines * 64;
    if (pf_to_l2)
      prefetch_lines<_MM_HINT_T1>(ahead, pf_lines);
    else
      prefetch_lines<_MM_HINT_T0>(ahead, pf_lines);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + 512, 64);
    _tile_loadd(4, x0 + kb * 32, ld0 * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (BLOCKS == 2) {
      _tile_loadd(5, x1 + kb * 32, ld1 * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, cbuf, 128);
  _tile_stored(1, cbuf + 16, 128);
  if (BLOCKS == 2) {
    _tile_stored(2, cbuf + 16 * 32, 128);
    _tile_stored(3, cbuf + 16 * 32 + 16, 128);
  }
}
#endif  // KVSERVE_AMX

}  // namespace

bool amx_supported() {
#if defined(KVSERVE_AMX)
  return amx_tiles_granted();
#else
  return false;
#endif
}

void amx_linear(Tensor out, const Tensor& x, const Tensor& packed) {
  TORCH_CHECK(amx_supported(), "amx_linear: this build or CPU has no AMX-BF16");
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu() && packed.device().is_cpu(),
              "amx_linear: tensors must be on CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                  packed.scalar_type() == at::kBFloat16,
              "amx_linear: x, out and packed must be bfloat16");
  TORCH_CHECK(packed.dim() == 5 && packed.size(2) == 2 && packed.size(3) == 16 &&
                  packed.size(4) == 32 && packed.is_contiguous(),
              "amx_linear: packed must be a contiguous [ceil(N/32), ceil(K/32), 2, 16, 32] tensor");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "amx_linear: x and out must be 2-D");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  const int64_t kpad = packed.size(1) * 32;
  TORCH_CHECK(x.stride(1) == 1 && k <= kpad && k > kpad - 32,
              "amx_linear: x must be [M, K] with contiguous rows and ceil(K/32) = ",
              packed.size(1), ", got ", x.sizes());
  TORCH_CHECK(out.size(0) == m && out.stride(1) == 1 && n <= packed.size(0) * 32 &&
                  n > packed.size(0) * 32 - 32,
              "amx_linear: out must be [", m, ", N] with contiguous rows and ceil(N/32) = ",
              packed.size(0), ", got ", out.sizes());
  if (m == 0) return;
#if defined(KVSERVE_AMX)
  const int64_t mpad = (m + 15) / 16 * 16;
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const int64_t ldx = x.stride(0);
  // NOTE: every tile is a whole one (one config): rows up to a multiple of 16 and inputs up
  // to one of 32 are zeros, so padded weight columns meet zeros, never another row's data.
  // Whole 16-row blocks are read from x in place; only the last, partial block is copied (or
  // every row, when K is not a multiple of 32 or x's rows are not 64-byte aligned), into a
  // 64-byte aligned buffer, so that no tile row straddles two cache lines. Copying all of x
  // whenever M % 16 != 0, as before, made the model's projections 9-18 % slower at M = 36,
  // 52 and 68 (the AMX Xeon, 2026-12-02, 6778ddc; bench/probes/amx_model_ab.py and
  // bench/results/session10/amx_inplace_ab.txt, both at 25ace60).
  const bool aligned = reinterpret_cast<uintptr_t>(xs) % 64 == 0 && ldx % 32 == 0;
  const int64_t full = kpad == k && aligned ? m / 16 * 16 : 0;  // rows read in place
  thread_local std::vector<uint16_t> padded;
  uint16_t* tail = nullptr;  // rows [full, mpad), zero-padded, row stride kpad
  if (full < mpad) {
    padded.resize((mpad - full) * kpad + 32);
    tail = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(padded.data()) + 63) &
                                       ~uintptr_t(63));
    std::fill(tail, tail + (mpad - full) * kpad, uint16_t(0));
    for (int64_t r = full; r < m; ++r)
      std::memcpy(tail + (r - full) * kpad, xs + r * ldx, k * 2);
  }
  // The first of 16 rows from r on (r a multiple of 16), and its row stride.
  auto block_rows = [&](int64_t r, int64_t& ld) -> const uint16_t* {
    ld = r < full ? ldx : kpad;
    return r < full ? xs + r * ldx : tail + (r - full) * kpad;
  };
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t ldo = out.stride(0);
  const int64_t pairs = (mpad + 31) / 32, kblocks = kpad / 32;
  const int pf_share = static_cast<int>((32 + pairs - 1) / pairs);  // lines per k block
  at::parallel_for(0, packed.size(0), 1, [&](int64_t g0, int64_t g1) {
    load_tile_config();
    alignas(64) float cbuf[32 * 32];
    for (int64_t g = g0; g < g1; ++g) {
      const uint16_t* wg = w + g * 32 * kpad;
      const int64_t cols = std::min<int64_t>(32, n - g * 32);
      const __mmask32 keep = cols == 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
      for (int64_t r0 = 0; r0 < mpad; r0 += 32) {
        // NOTE: which lines to prefetch. With one row pair the group's own tiles, 4 KiB ahead,
        // into L1 (over the hardware prefetcher alone: bare-runner decode +4 / +8 / +10 % at
        // B=1 / 8 / 32, 2026-12-02, 24ca3db; 25ace60:bench/results/session9/ab_prefetch). With
        // several, the group's tiles come from memory for the first pair only and from the
        // caches after, so the memory would idle; instead each pair brings its share of the
        // next group's tiles into L2 (cold gate/up 3072x576 at M=128: 410 -> 318 us, 7797456;
        // git show 25ace60:bench/results/session9/amx_prefetch_groups.txt).
        const bool to_l2 = pairs > 1;
        const int lines = to_l2 ? pf_share : 32;
        const char* pf = reinterpret_cast<const char*>(wg) + kPrefetchBytes;
        if (to_l2)
          pf = reinterpret_cast<const char*>(wg + 32 * kpad) + (r0 / 32) * kblocks * lines * 64;
        int64_t ld0 = 0, ld1 = 0;
        const uint16_t* x0 = block_rows(r0, ld0);
        if (mpad - r0 >= 32) {
          const uint16_t* x1 = block_rows(r0 + 16, ld1);
          group_tiles<2>(x0, ld0, x1, ld1, kpad, wg, cbuf, pf, lines, to_l2);
        } else {
          group_tiles<1>(x0, ld0, x0, ld0, kpad, wg, cbuf, pf, lines, to_l2);
        }
        store_rows_bf16(cbuf, std::min<int64_t>(32, m - r0), o + r0 * ldo + g * 32, ldo, keep);
      }
    }
    _tile_release();
  });
#endif
}

}  // namespace kvserve
