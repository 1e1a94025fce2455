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

template <int R, int T>
KVQ_K_AVX2 void tile_avx2(const uint8_t* w, int64_t row_bytes, const QAct& a, int64_t t0,
                          float* res) {
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
  const __m256i k32 = _mm256_set1_epi8(32);
  for (int64_t s = 0; s < a.k / kSuper; ++s) {
    float dw[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = w + r * row_bytes + s * kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * kBytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * kBytes + 128), _MM_HINT_T0);
      dw[r] = _cvtsh_ss(load_u16(blk + 208));
    }
    for (int h = 0; h < 2; ++h) {
      for (int c = 0; c < 4; ++c) {
        const int64_t b = s * 8 + 4 * h + c;
        __m256i xv[T], x32[T];
        float xd[T];
        for (int t = 0; t < T; ++t) {
          const int64_t row = t0 + t;
          xv[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + row * a.k + b * kBlock));
          x32[t] = _mm256_maddubs_epi16(k32, xv[t]);  // 32 * (x_2i + x_2i+1)
          xd[t] = a.d[row * a.nb + b];
        }
        for (int r = 0; r < R; ++r) {
          const uint8_t* blk = w + r * row_bytes + s * kBytes;
          const __m256i l = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(blk + 64 * h + 32 * (c & 1)));
          const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
          const __m256i lo = c < 2 ? _mm256_and_si256(l, low4)
                                   : _mm256_and_si256(_mm256_srli_epi16(l, 4), low4);
          const __m256i hi =
              _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * c)), three), 4);
          const __m256i q = _mm256_or_si256(lo, hi);  // 0..63
          const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192 + 8 * h + 2 * c);
          const __m256i scale =
              _mm256_set_m128i(_mm_set1_epi16(sc[1]), _mm_set1_epi16(sc[0]));
          for (int t = 0; t < T; ++t) {
            // NOTE: pairs of (q - 32) x: q x and 32 x apart stay within int16 (63 * 127 * 2),
            // and so does their difference; times the int8 scale in 32 bits.
            const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(q, xv[t]), x32[t]);
            const __m256i dot = _mm256_madd_epi16(p, scale);
            acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw[r] * xd[t]),
                                        acc[r][t]);
          }
        }
      }
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
