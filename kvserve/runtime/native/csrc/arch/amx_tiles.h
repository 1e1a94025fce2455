// What the AMX kernels share: those of the `kvserve` op library (amx_linear.cpp,
// amx_attention.cpp, amx_int8.cpp) and of `kvserve_quant`
// (quant/quant_amx_bf16.cpp's amx_bf16_linear): the tile state request, the one tile
// configuration they use, and the store of an fp32 result as bf16 rows.
#pragma once

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace kvserve {

// Whether the kernel granted this process the AMX tile data state (arch_prctl
// ARCH_REQ_XCOMP_PERM, asked once); without it the first tile instruction faults.
inline bool amx_tiles_granted() {
  constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: request an XSAVE feature
  constexpr long kXfeatureXtiledata = 18;     // the AMX tile data state
  static const bool granted =
      syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

// The tile configuration: all eight tiles 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Load that configuration on the calling thread.
// NOTE: from a static object: GCC 12 does not count _tile_loadconfig as reading its operand, so
// the stores of a configuration built on the stack may be removed as dead. Inlined into its
// caller they survive; called out of line (tried on the AMX Xeon, 2026-12-04) they were gone
// and ldtilecfg faulted on the garbage.
inline void load_tile_config() {
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    return c;
  }();
  _tile_loadconfig(&cfg);
}

// Rows [0, rows) of an fp32 result buf [rows][32] -> bf16 rows of out (row stride ldo), the
// columns in `keep` of 32, each rounded once (RNE).
inline void store_rows_bf16(const float* buf, int64_t rows, uint16_t* out, int64_t ldo,
                            __mmask32 keep) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_load_ps(buf + r * 32);
    const __m512 hi = _mm512_load_ps(buf + r * 32 + 16);
    _mm512_mask_storeu_epi16(out + r * ldo, keep, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

}  // namespace kvserve
#endif  // __AMX_TILE__
