// Q5_K as stored (block_q5_K, 176 bytes / 256 values: fp16 d, fp16 dmin, 12 bytes of 6-bit
// scales and mins, 32 bytes of high bits qh, 128 bytes of nibbles): value = d * sc * q - dmin
// * m per 32-value sub-block, q = nibble | bit << 4. As Q4_K, bytes 32 j .. 32 j + 31 of the
// nibbles hold sub-blocks 2 j (low) and 2 j + 1 (high); value l of sub-block i takes bit i of
// qh[l]. The dot: scalar, and AVX2 tiles of 4 rows x 2 tokens (quant_kquant.h).
#include "quant_kquant.h"

namespace kvserve_quant {

namespace {

constexpr int64_t kBytes = 176;

// Value l of sub-block 2 j (hi = 0) or 2 j + 1 (hi = 1): 0..31.
inline int q5(const uint8_t* blk, int j, int hi, int l) {
  const uint8_t n = blk[48 + 32 * j + l];
  return (hi ? n >> 4 : n & 0x0F) | (((blk[16 + l] >> (2 * j + hi)) & 1) << 4);
}

float dot_scalar(const uint8_t* w, const QAct& a, int64_t t) {
  const int8_t* xq = a.q + t * a.k;
  const float* xd = a.d + t * a.nb;
  const float* xs = a.s + t * a.nb;
  float acc = 0.0f;
  for (int64_t s = 0; s < a.k / kSuper; ++s) {
    const uint8_t* blk = w + s * kBytes;
    const float d = load_half(blk), dmin = load_half(blk + 2);
    uint8_t sc[8], mn[8];
    kquant_scale_min(blk + 4, sc, mn);
    for (int j = 0; j < 4; ++j) {
      const int8_t* x = xq + s * kSuper + 64 * j;
      int32_t lo = 0, hi = 0;
      for (int i = 0; i < 32; ++i) {
        lo += q5(blk, j, 0, i) * x[i];
        hi += q5(blk, j, 1, i) * x[32 + i];
      }
      const int64_t b = s * 8 + 2 * j;
      acc += d * sc[2 * j] * xd[b] * static_cast<float>(lo) - dmin * mn[2 * j] * xs[b];
      acc += d * sc[2 * j + 1] * xd[b + 1] * static_cast<float>(hi) -
             dmin * mn[2 * j + 1] * xs[b + 1];
    }
  }
  return acc;
}

// Bit b of every byte of qh moved to bit 4 (the rest zero): shifted in 16-bit lanes, then
// masked per byte (for b in 0..7 no bit crossing from the other byte lands on bit 4).
KVQ_K_AVX2 inline __m256i bit_to_4(__m256i qh, int b) {
  const __m256i moved = b <= 4 ? _mm256_sll_epi16(qh, _mm_cvtsi32_si128(4 - b))
                               : _mm256_srl_epi16(qh, _mm_cvtsi32_si128(b - 4));
  return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
}

// The 8 sub-block dots of one super-block (qh 32 bytes, then the nibbles) with activations
// x (256).
KVQ_K_AVX2 inline __m256i super_dots(const uint8_t* qh_p, const int8_t* x) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh_p));
  const uint8_t* qs = qh_p + 32;
  __m256i d[8];
  for (int j = 0; j < 4; ++j) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 64 * j));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 64 * j + 32));
    const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low4), bit_to_4(qh, 2 * j));
    const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4),
                                       bit_to_4(qh, 2 * j + 1));
    // NOTE: vpmaddubsw pairs: 31 * 127 * 2 stays below the int16 saturation.
    d[2 * j] = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), ones);
    d[2 * j + 1] = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), ones);
  }
  return kq_sum8(d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]);
}

template <int R, int T>
constexpr KTileFn tile = &scale_min_tile_avx2<R, T, kBytes, &super_dots>;
const KTiles kTiles = {{{tile<1, 1>, tile<1, 2>}, {tile<4, 1>, tile<4, 2>}}};

}  // namespace

void q5_k_dequant(const uint8_t* row, int64_t k, float* o) {
  for (int64_t s = 0; s < k / kSuper; ++s) {
    const uint8_t* blk = row + s * kBytes;
    const float d = load_half(blk), dmin = load_half(blk + 2);
    uint8_t sc[8], mn[8];
    kquant_scale_min(blk + 4, sc, mn);
    float* y = o + s * kSuper;
    for (int j = 0; j < 4; ++j) {
      // NOTE: (d * sc) * q - (dmin * m), the order of gguf.quants and llama.cpp.
      const float d1 = d * sc[2 * j], m1 = dmin * mn[2 * j];
      const float d2 = d * sc[2 * j + 1], m2 = dmin * mn[2 * j + 1];
      for (int i = 0; i < 32; ++i) {
        y[64 * j + i] = d1 * q5(blk, j, 0, i) - m1;
        y[64 * j + 32 + i] = d2 * q5(blk, j, 1, i) - m2;
      }
    }
  }
}

void q5_k_tile(const uint8_t* w, int64_t row_bytes, int rows, const QAct& a, int64_t t0,
               int tokens, float* res, int isa) {
  run_ktile(kTiles, &dot_scalar, w, row_bytes, rows, a, t0, tokens, res, isa);
}

}  // namespace kvserve_quant
