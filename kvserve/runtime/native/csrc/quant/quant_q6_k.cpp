// Q6_K as stored (block_q6_K, 210 bytes / 256 values: 128 bytes of low nibbles ql, 64 bytes of
// high bit pairs qh, 16 int8 scales, fp16 d): value = d * sc * (q - 32) per 16-value
// sub-block. In each half h of 128 values, value 32 c + l (c = 0..3, l = 0..31) has the low
// (c < 2) or high nibble of ql[64 h + 32 (c & 1) + l] and bits 2 c, 2 c + 1 of qh[32 h + l].
// The dot: scalar, and AVX2 tiles of 4 rows x 2 tokens (quant_kquant.h); per 32-value
// activation block the two sub-blocks' int32 dots are scaled by their int8 scales in integers.
#include "quant_kquant.h"

namespace kvserve_quant {

namespace {

constexpr int64_t kBytes = 210;

// The 6-bit value (0..63) i of activation block c of half h.
inline int q6(const uint8_t* blk, int h, int c, int i) {
  const uint8_t l = blk[64 * h + 32 * (c & 1) + i];
  const int lo = c < 2 ? (l & 0x0F) : (l >> 4);
  return lo | (((blk[128 + 32 * h + i] >> (2 * c)) & 3) << 4);
}

float dot_scalar(const uint8_t* w, const QAct& a, int64_t t) {
  const int8_t* xq = a.q + t * a.k;
  const float* xd = a.d + t * a.nb;
  float acc = 0.0f;
  for (int64_t s = 0; s < a.k / kSuper; ++s) {
    const uint8_t* blk = w + s * kBytes;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = load_half(blk + 208);
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < 4; ++c) {
        const int64_t b = s * 8 + 4 * h + c;
        const int8_t* x = xq + b * kBlock;
        int32_t d0 = 0, d1 = 0;
        for (int i = 0; i < 16; ++i) {
          d0 += (q6(blk, h, c, i) - 32) * x[i];
          d1 += (q6(blk, h, c, 16 + i) - 32) * x[16 + i];
        }
        const int32_t dot = sc[8 * h + 2 * c] * d0 + sc[8 * h + 2 * c + 1] * d1;
        acc += d * xd[b] * static_cast<float>(dot);
      }
  }
  return acc;
}

// The 8 activation blocks' dots of one super-block for T tokens (x[t]: their 256
// activations), each block's two 16-value sub-blocks scaled by their int8 scales in integers:
// out[t] lane i = activation block i. The weights are decoded once for the T tokens.
template <int T>
KVQ_K_AVX2 inline void super_dots(const uint8_t* blk, const int8_t* const* x, __m256i* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
  const __m256i k32 = _mm256_set1_epi8(32);
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  __m256i half[2][T];  // per half: blocks 4h..4h+3 reduced to [b0, b1, b2, b3 | b0', ...]
  for (int h = 0; h < 2; ++h) {
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    __m256i q[4], scale[4];
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, low4),
                           _mm256_slli_epi16(_mm256_and_si256(hb, three), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(l1, low4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), three), 4));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                           _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                           _mm256_and_si256(_mm256_srli_epi16(hb, 2), _mm256_set1_epi8(0x30)));
    for (int c = 0; c < 4; ++c) {
      const int b = 4 * h + c;
      scale[c] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * b + 1]), _mm_set1_epi16(sc[2 * b]));
    }
    for (int t = 0; t < T; ++t) {
      __m256i d[4];
      for (int c = 0; c < 4; ++c) {
        const __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[t] + 32 * (4 * h + c)));
        // NOTE: pairs of (q - 32) x: q x and 32 x apart stay within int16 (63 * 127 * 2),
        // and so does their difference; times the int8 scale in 32 bits.
        const __m256i p =
            _mm256_sub_epi16(_mm256_maddubs_epi16(q[c], xv), _mm256_maddubs_epi16(k32, xv));
        d[c] = _mm256_madd_epi16(p, scale[c]);
      }
      half[h][t] = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
    }
  }
  for (int t = 0; t < T; ++t)
    out[t] = _mm256_add_epi32(_mm256_permute2x128_si256(half[0][t], half[1][t], 0x20),
                              _mm256_permute2x128_si256(half[0][t], half[1][t], 0x31));
}

// Per super-block and row: the 8 activation blocks' scaled dots of each token in one vector,
// then d xd dot in fp32 lane by lane.
template <int R, int T>
KVQ_K_AVX2 void tile_avx2(const uint8_t* w, int64_t row_bytes, const QAct& a, int64_t t0,
                          float* res) {
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t s = 0; s < a.k / kSuper; ++s) {
    __m256 xd[T];
    const int8_t* x[T];
    for (int t = 0; t < T; ++t) {
      xd[t] = _mm256_loadu_ps(a.d + (t0 + t) * a.nb + s * 8);
      x[t] = a.q + (t0 + t) * a.k + s * kSuper;
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * row_bytes + s * kBytes;
      for (int line = 0; line < 4; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * kBytes + 64 * line), _MM_HINT_T0);
      const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(blk + 208)));
      __m256i dots[T];
      super_dots<T>(blk, x, dots);
      for (int t = 0; t < T; ++t)
        acc[r][t] =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[t]), _mm256_mul_ps(d, xd[t]), acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) res[r * T + t] = kq_hsum256(acc[r][t]);
}

const KTiles kTiles = {{{&tile_avx2<1, 1>, &tile_avx2<1, 2>}, {&tile_avx2<4, 1>, &tile_avx2<4, 2>}}};

}  // namespace

void q6_k_dequant(const uint8_t* row, int64_t k, float* o) {
  for (int64_t s = 0; s < k / kSuper; ++s) {
    const uint8_t* blk = row + s * kBytes;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = load_half(blk + 208);
    float* y = o + s * kSuper;
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < 32; ++i) {
          const int v = 128 * h + 32 * c + i;
          // NOTE: (d * sc) * (q - 32), the order of gguf.quants.
          y[v] = d * static_cast<float>(sc[v / 16]) * static_cast<float>(q6(blk, h, c, i) - 32);
        }
  }
}

void q6_k_tile(const uint8_t* w, int64_t row_bytes, int rows, const QAct& a, int64_t t0,
               int tokens, float* res, int isa) {
  run_ktile(kTiles, &dot_scalar, w, row_bytes, rows, a, t0, tokens, res, isa);
}

}  // namespace kvserve_quant
