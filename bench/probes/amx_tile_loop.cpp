// The AMX kernel's inner loop alone (kvserve_amx_linear.cpp, group_tiles<2>): ns per k block
// (4 tile loads, 4 TDPBF16PS into 2x2 C tiles) with the operands in registers, in L1 and in L2.
//
//   g++ -O2 -mamx-tile -mamx-bf16 bench/probes/amx_tile_loop.cpp -o /tmp/amx_tile_loop
//   /tmp/amx_tile_loop
//
// "registers": the 4 multiplies with no loads; "L1": the loads read the same 4 KiB each
// k block; "L2": the loads walk a 32-column group of K = 576 (36 KiB of tiles) and 32 rows of
// x at the model's row stride (1152 bytes; 36 KiB), which together overflow L1.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace {
struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
alignas(64) float cbuf[32 * 32];
constexpr int kK = 576, kKb = kK / 32, kReps = 20000;

template <int MODE>  // 0: registers, 1: L1, 2: L2
double ns_per_kblock(const uint16_t* w, const uint16_t* x) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int rep = 0; rep < kReps; ++rep) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int kb = 0; kb < kKb; ++kb) {
      if (MODE > 0) {
        const uint16_t* b = MODE == 2 ? w + kb * 1024 : w;
        const uint16_t* a = MODE == 2 ? x + kb * 32 : x;
        const int stride = MODE == 2 ? kK * 2 : 64;
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + 512, 64);
        _tile_loadd(4, a, stride);
        _tile_loadd(5, a + 16 * (MODE == 2 ? kK : 32), stride);
      }
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, cbuf, 128);
  }
  const std::chrono::duration<double, std::nano> dt = std::chrono::steady_clock::now() - t0;
  return dt.count() / kReps / kKb;
}
}  // namespace

int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    std::puts("no AMX tile state granted (not an AMX CPU?)");
    return 1;
  }
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
  auto* w = static_cast<uint16_t*>(std::aligned_alloc(64, 32 * kK * 2));
  auto* x = static_cast<uint16_t*>(std::aligned_alloc(64, 32 * kK * 2));
  for (int i = 0; i < 32 * kK; ++i) w[i] = x[i] = 0x3f80;  // bf16 1.0
  _tile_loadd(4, x, 64);
  _tile_loadd(5, x, 64);
  _tile_loadd(6, w, 64);
  _tile_loadd(7, w, 64);
  for (int pass = 0; pass < 2; ++pass)
    std::printf("ns per k block (4 loads + 4 tdpbf16ps): registers %.1f, L1 %.1f, L2 %.1f\n",
                ns_per_kblock<0>(w, x), ns_per_kblock<1>(w, x), ns_per_kblock<2>(w, x));
  _tile_release();
  return 0;
}
