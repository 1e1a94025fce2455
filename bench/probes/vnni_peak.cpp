// The core's issue rate of 512-bit vpdpbusd and vfmadd231ps from registers (12 independent
// chains each): the ceiling the int8-dot kernels are read against (README, "Kernels and
// dtype", session 12).
//
//   g++ -O2 -march=native bench/probes/vnni_peak.cpp -o /tmp/vnni_peak && /tmp/vnni_peak
#include <immintrin.h>

#include <chrono>
#include <cstdio>

int main() {
  constexpr long kIters = 200000000;
  __m512i acc[12];
  __m512 f[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_epi32(i), f[i] = _mm512_set1_ps(i);
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  __m512 fa = _mm512_set1_ps(1.0001f), fb = _mm512_set1_ps(0.9999f);
  const auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < kIters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    __asm__ volatile("" : "+v"(a));  // keep the loop from being folded
  }
  const auto t1 = std::chrono::steady_clock::now();
  for (long n = 0; n < kIters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) f[i] = _mm512_fmadd_ps(f[i], fa, fb);
    __asm__ volatile("" : "+v"(fa));
  }
  const auto t2 = std::chrono::steady_clock::now();
  __m512i s = acc[0];
  __m512 fs = f[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_epi32(s, acc[i]), fs = _mm512_add_ps(fs, f[i]);
  const double d1 = std::chrono::duration<double>(t1 - t0).count();
  const double d2 = std::chrono::duration<double>(t2 - t1).count();
  const double ops = static_cast<double>(kIters) * 12;
  std::printf("vpdpbusd zmm: %.3f ns each, %.2f G/s (%.0f GMAC/s int8); vfmadd231ps zmm: %.3f ns "
              "each [%d %g]\n",
              d1 / ops * 1e9, ops / d1 / 1e9, 64 * ops / d1 / 1e9, d2 / ops * 1e9,
              _mm512_reduce_add_epi32(s), _mm512_reduce_add_ps(fs));
}
