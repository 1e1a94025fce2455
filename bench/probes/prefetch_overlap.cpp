// Whether a thread's cold reads overlap its arithmetic, by how it prefetches: a synthetic
// stream shaped like decode attention's (blocks of 96 lines, 6 KB, in random order, read a
// line at a time with W rounds of 8 independent FMAs per line).
//
//   g++ -O2 -march=native bench/probes/prefetch_overlap.cpp -o /tmp/prefetch_overlap
//   /tmp/prefetch_overlap W MODE [D] [hot]
//
// MODE 0: no software prefetch (the hardware prefetchers only); 1: the next block's 96 lines
// at the start of each block (what for_each_visible_run does); 2: one line D lines ahead per
// line read; 3: 8 lines every 8 lines; 4: 32 lines every 32 lines; 5: as 2 into L1. "hot":
// 16 blocks read again and again (the arithmetic alone). Prints ns a line (best of 5 passes
// over 96 MB of a 384 MB buffer; hot: of 20000 passes).
// Session 22, the AMX Xeon (bench/results/session22/prefetch_overlap.txt), W=1: hot 5.9 ns;
// cold 12.9 (mode 0), 13.7 (1), 13.5 (4), 10.0 (3), 9.8 (2, D=64): with no prefetch or in
// bursts the cold read and the arithmetic add up; a few lines at a time they overlap.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s W MODE [D] [hot]\n", argv[0]);
    return 2;
  }
  const int W = std::atoi(argv[1]);
  const int mode = std::atoi(argv[2]);
  const int D = argc > 3 ? std::atoi(argv[3]) : 32;
  const bool hot = argc > 4;
  constexpr size_t kLines = 96, kBlock = kLines * 64, kBlocks = 64 * 1024;  // 384 MB
  char* buf = static_cast<char*>(std::aligned_alloc(2 << 20, kBlocks * kBlock));
  std::memset(buf, 1, kBlocks * kBlock);
  std::vector<int> order(kBlocks);
  for (size_t i = 0; i < kBlocks; ++i) order[i] = static_cast<int>(i);
  std::shuffle(order.begin(), order.end(), std::mt19937(1));
  const size_t use = hot ? 16 : 16384;  // blocks a pass
  __m512 acc[8];
  for (auto& a : acc) a = _mm512_set1_ps(1.0f);
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.001f);
  auto ahead = [&](const char* blk, const char* next, int t) {
    return t < static_cast<int>(kLines) ? blk + t * 64 : next + (t - kLines) * 64;
  };
  double best = 1e9;
  for (int pass = 0; pass < (hot ? 20000 : 5); ++pass) {
    const size_t off = (pass % 3) * use;  // a different 96 MB each pass: cold
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t k = 0; k < use; ++k) {
      const char* blk = buf + order[off + k] * kBlock;
      const char* next = buf + order[off + k + 1] * kBlock;
      if (mode == 1)
        for (size_t l = 0; l < kLines; ++l) _mm_prefetch(next + l * 64, _MM_HINT_T1);
      for (int l = 0; l < static_cast<int>(kLines); ++l) {
        if (mode == 2) _mm_prefetch(ahead(blk, next, l + D), _MM_HINT_T1);
        if (mode == 5) _mm_prefetch(ahead(blk, next, l + D), _MM_HINT_T0);
        if (mode == 3 && l % 8 == 0)
          for (int u = 0; u < 8; ++u) _mm_prefetch(ahead(blk, next, l + u + D), _MM_HINT_T1);
        if (mode == 4 && l % 32 == 0)
          for (int u = 0; u < 32; ++u) _mm_prefetch(ahead(blk, next, l + u + D), _MM_HINT_T1);
        const __m512 v = _mm512_load_ps(reinterpret_cast<const float*>(blk + l * 64));
        acc[l & 7] = _mm512_add_ps(acc[l & 7], v);
        for (int w = 0; w < W; ++w)
          for (auto& x : acc) x = _mm512_fmadd_ps(x, a, b);
      }
    }
    const double ns = std::chrono::duration<double, std::nano>(
                          std::chrono::steady_clock::now() - t0).count() / (use * kLines);
    best = std::min(best, ns);
  }
  __m512 sum = acc[0];
  for (int i = 1; i < 8; ++i) sum = _mm512_add_ps(sum, acc[i]);
  std::printf("W=%d mode=%d D=%d%s: %.2f ns a line (%.1f GB/s) [checksum %g]\n", W, mode, D,
              hot ? " hot" : "", best, 64 / best, _mm512_reduce_add_ps(sum));
  std::free(buf);
  return 0;
}
