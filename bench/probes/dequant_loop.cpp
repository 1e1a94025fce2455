// amx_bf16_linear's dequantization alone (kvserve_quant_ops.cpp, dequant_btile for Q4_1 x16):
// the model's 105 M Q4_1 projection weights turned into bf16 B tiles, one thread, cold (66 MB
// streamed from memory) and hot (the same 640 KB again and again); with -DNOPERM the one
// vpermw per 32 weights that pairs the tile rows is left out (the output then is not a valid
// tile: what a pair-interleaved weight layout would save).
//   g++ -O2 -march=native bench/probes/dequant_loop.cpp -o /tmp/deq && /tmp/deq && /tmp/deq hot
//   g++ -O2 -march=native -DNOPERM bench/probes/dequant_loop.cpp -o /tmp/deq_np && /tmp/deq_np hot
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <chrono>
#include <vector>
#include <cstring>
#define T __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))
template <int J, bool HIGH> T inline __m512 lane_value(__m512i wv) {
  const __m512i s = _mm512_srli_epi32(wv, 8 * J + (HIGH ? 4 : 0));
  const __m512i b = _mm512_ternarylogic_epi32(s, _mm512_set1_epi32(0x0F), _mm512_set1_epi32(0x4B000000), 0xEA);
  return _mm512_sub_ps(_mm512_castsi512_ps(b), _mm512_set1_ps(8388608.0f));
}
T inline void store_pairs(__m512 w0, __m512 w1, uint16_t* row) {
  const __m512i words = (__m512i)_mm512_cvtne2ps_pbh(w1, w0);
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
#ifdef NOPERM
  _mm512_storeu_si512(row, words);
#else
  _mm512_storeu_si512(row, _mm512_permutexvar_epi16(pairs, words));
#endif
}
template <bool HIGH> T inline void chunk_to_tile(__m512i wv, __m512 d, __m512 m, uint16_t* tile, int kp) {
  store_pairs(_mm512_fmadd_ps(lane_value<0, HIGH>(wv), d, m), _mm512_fmadd_ps(lane_value<1, HIGH>(wv), d, m), tile + kp * 32);
  store_pairs(_mm512_fmadd_ps(lane_value<2, HIGH>(wv), d, m), _mm512_fmadd_ps(lane_value<3, HIGH>(wv), d, m), tile + (kp + 1) * 32);
}
T void dequant_btile(const uint8_t* blk, uint16_t* tile) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 32)));
  const uint8_t* v = blk + 64;
  for (int c = 0; c < 4; ++c) {
    const __m512i wv = _mm512_loadu_si512(v + 64 * c);
    chunk_to_tile<false>(wv, d, m, tile, 2 * c);
    chunk_to_tile<true>(wv, d, m, tile, 8 + 2 * c);
  }
}
int main(int argc, char** argv) {
  const size_t blocks = 66e6 / 320;  // 66 MB of Q4_1 x16 group-blocks
  std::vector<uint8_t> w(blocks * 320);
  for (size_t i = 0; i < w.size(); ++i) w[i] = (i * 2654435761u) >> 13;
  for (size_t b = 0; b < blocks; ++b) { uint16_t* h = (uint16_t*)&w[b*320]; for (int i=0;i<32;++i) h[i] = 0x2000 + (i*37 & 0xff); }
  alignas(64) static uint16_t tile[18 * 1024];
  const size_t hot = argc > 1 ? 2000 : blocks;  // hot: 640 KB reused
  for (int rep = 0; rep < 4; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    size_t n = 0;
    for (size_t it = 0; n < blocks; ++it)
      for (size_t b = 0; b < hot && n < blocks; ++b, ++n) dequant_btile(&w[b * 320], tile + (n % 36) * 512);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("%s: %.2f ms for %zu Mweights: %.2f ns/weight-x1000 -> %.3f cycles/weight @3GHz\n", hot==blocks?"cold":"hot", s*1e3, blocks*512/1000000, s/(blocks*512)*1e12, s/(blocks*512)*3e9);
  }
}
