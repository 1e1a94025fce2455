// kvserve_quant::amx_bf16_linear: bf16 activations times x16 weights dequantized to bf16 AMX
// tiles inside the GEMM (an AMX-BF16 build only; elsewhere the op refuses).
#include "quant_common.h"

namespace kvserve_quant {

namespace {

// ---- amx_bf16_linear: the x16 weights dequantized to bf16 AMX tiles inside the GEMM ------
//
// out [M, N] = x [M, K] @ W^T in bf16, W read in the x16 layout and dequantized per group of
// 32 output columns into the tile layout of amx_linear.cpp, then multiplied exactly
// as that kernel multiplies its packed copy (same tiles, same k order, fp32 accumulation, one
// RNE rounding to bf16). Each weight is dequantized as the dense copy is (d * q + m in fp32,
// rounded to bf16), so the output equals the `dequant_amx_bf16` copy's bit for bit.
// NOTE: why: from ~16 rows a step is compute bound in the int8-dot kernels and the dense
// bf16 copy won, streaming 3.6x the bytes of the Q4_1 weights and holding a second copy of
// every one; dequantizing inside the GEMM costs the same work for any M, once per call.
#if defined(KVQ_HAVE_AMX)
#define KVQ_AMXBF16                                                                      \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16," \
                        "fma,f16c")))

// Lane r: byte J of lane r of `wv` as a float: q8_0's signed value, or a nibble format's low
// nibble (HIGH: its high nibble).
// NOTE: int to float through the float bits of 2^23 + q (an add or an OR, then a subtraction,
// both exact) instead of vcvtdq2ps, which shares its port with the shifts: a layer's Q4_1
// projections at M = 32 took 224-237 us against 243-256 (the AMX Xeon,
// 2026-12-04, 9d2c47f; git show 25ace60:bench/results/session21/magic_ab.txt).
template <int QT, int J, bool HIGH>
KVQ_AMXBF16 inline __m512 lane_value(__m512i wv) {
  if constexpr (QT == kQ8_0) {
    // 2^23 + 2^22 + q as float bits, minus 2^23 + 2^22: q exactly (|q| < 2^22).
    const __m512i q = _mm512_srai_epi32(_mm512_slli_epi32(wv, 24 - 8 * J), 24);
    const __m512i b = _mm512_add_epi32(q, _mm512_set1_epi32(0x4B400000));
    return _mm512_sub_ps(_mm512_castsi512_ps(b), _mm512_set1_ps(12582912.0f));
  } else {
    // (x & 15) | bits of 2^23 in one ternary-logic op: the float 2^23 + q, minus 2^23: q.
    const __m512i s = _mm512_srli_epi32(wv, 8 * J + (HIGH ? 4 : 0));
    const __m512i b = _mm512_ternarylogic_epi32(s, _mm512_set1_epi32(0x0F),
                                                _mm512_set1_epi32(0x4B000000), 0xEA);
    return _mm512_sub_ps(_mm512_castsi512_ps(b), _mm512_set1_ps(8388608.0f));
  }
}

// The weights of 16 rows: d * q (q8_0) or d * q + m (m = -8 d for q4_0, exact), in float.
template <int QT>
KVQ_AMXBF16 inline __m512 scaled(__m512 q, __m512 d, __m512 m) {
  return QT == kQ8_0 ? _mm512_mul_ps(q, d) : _mm512_fmadd_ps(q, d, m);
}

// One B tile row: 16 rows' weights k (w0, lane r = row r) and k + 1 (w1) as bf16 pairs.
KVQ_AMXBF16 inline void store_pairs(__m512 w0, __m512 w1, uint16_t* row) {
  const __m512i words = (__m512i)_mm512_cvtne2ps_pbh(w1, w0);  // [w0's 16 | w1's 16] (RNE)
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  _mm512_storeu_si512(row, _mm512_permutexvar_epi16(pairs, words));
}

// One 64-byte chunk (int32 lane r = 4 value bytes of row r) -> tile rows kp (the bytes' values
// 0 and 1) and kp + 1 (2 and 3); nibble formats: the low nibbles, or with HIGH the high ones.
// NOTE: lane r stays row r from the load to the store, so each step is one instruction per 16
// rows, the scales need no shuffling, and one word permute pairs two rows of values. Before
// be68d7a (2026-12-04) each 16 bytes were widened to 4 values of 4 rows per vector (an extract
// and a vpmovzx each, the scales shuffled to match, two 2-source permutes per tile row pair):
// about twice the shuffle-port work, and the dequantization is what bounds this kernel at
// decode sizes: its cost is per call, and M = 16 took 80-90 % of M = 32's time.
template <int QT, bool HIGH>
KVQ_AMXBF16 inline void chunk_to_tile(__m512i wv, __m512 d, __m512 m, uint16_t* tile, int kp) {
  store_pairs(scaled<QT>(lane_value<QT, 0, HIGH>(wv), d, m),
              scaled<QT>(lane_value<QT, 1, HIGH>(wv), d, m), tile + kp * 32);
  store_pairs(scaled<QT>(lane_value<QT, 2, HIGH>(wv), d, m),
              scaled<QT>(lane_value<QT, 3, HIGH>(wv), d, m), tile + (kp + 1) * 32);
}

// One x16 group-block (16 rows x 32 values) -> a B tile [16 kp][16 rows][2] bf16.
template <int QT>
KVQ_AMXBF16 void dequant_btile(const uint8_t* blk, uint16_t* tile) {
  constexpr int64_t VO = x16_values_offset(QT);
  // Lane r: row r's d and m.
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
  __m512 m = _mm512_setzero_ps();
  if constexpr (QT == kQ4_1)
    m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
  if constexpr (QT == kQ4_0) m = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));  // d (q - 8), exact
  const uint8_t* v = blk + VO;
  if constexpr (QT == kQ8_0) {
    for (int c = 0; c < 8; ++c)
      chunk_to_tile<QT, false>(_mm512_loadu_si512(v + 64 * c), d, m, tile, 2 * c);
  } else {
    for (int c = 0; c < 4; ++c) {
      const __m512i wv = _mm512_loadu_si512(v + 64 * c);
      chunk_to_tile<QT, false>(wv, d, m, tile, 2 * c);
      chunk_to_tile<QT, true>(wv, d, m, tile, 8 + 2 * c);
    }
  }
}

// Column group G (outputs 32G .. 32G + 31) for all k blocks -> bt [kblocks][2][16][32] bf16
// (amx_linear.cpp's packed layout); rows past N are zeros, plain tail rows take the
// scalar dequantization.
template <int QT>
KVQ_AMXBF16 void dequant_group(const uint8_t* wp, int64_t row_bytes, int64_t n, int64_t k,
                               int64_t G, uint16_t* bt, std::vector<float>& row_buf) {
  constexpr int64_t GB = kGroup * kBlockBytes[QT];
  const int64_t kblocks = k / kBlock, grouped = n / kGroup * kGroup;
  for (int h = 0; h < 2; ++h) {
    const int64_t r0 = G * 32 + h * 16;
    if (r0 + 16 <= grouped) {
      const uint8_t* g = wp + r0 * row_bytes;
      for (int64_t kb = 0; kb < kblocks; ++kb)
        dequant_btile<QT>(g + kb * GB, bt + kb * 1024 + h * 512);
      continue;
    }
    for (int64_t kb = 0; kb < kblocks; ++kb)
      std::fill(bt + kb * 1024 + h * 512, bt + kb * 1024 + h * 512 + 512, uint16_t{0});
    row_buf.resize(static_cast<size_t>(k));
    for (int c = 0; c < 16 && r0 + c < n; ++c) {
      dequant_row<float>(wp, row_bytes, n, kGroup, r0 + c, QT, k, row_buf.data());
      for (int64_t kk = 0; kk < k; ++kk) {
        const c10::BFloat16 b(row_buf[kk]);  // RNE, as the dense copy's .to(bfloat16)
        bt[(kk / 32) * 1024 + h * 512 + (kk % 32 / 2) * 32 + 2 * c + kk % 2] = b.x;
      }
    }
  }
}

template <int QT>
KVQ_AMXBF16 void run_amx_bf16(const uint16_t* xs, int64_t ldx, int64_t m, int64_t k,
                              const uint8_t* wp, int64_t row_bytes, int64_t n, uint16_t* o,
                              int64_t ldo) {
  const int64_t mpad = (m + 15) / 16 * 16, kblocks = k / kBlock;
  // NOTE: as amx_linear.cpp: whole 16-row blocks read in place when 64-byte aligned,
  // the rest copied zero-padded, so no tile row straddles two cache lines.
  const bool aligned = reinterpret_cast<uintptr_t>(xs) % 64 == 0 && ldx % 32 == 0;
  const int64_t full = aligned ? m / 16 * 16 : 0;
  thread_local std::vector<uint16_t> padded;
  uint16_t* tail = nullptr;
  if (full < mpad) {
    padded.resize((mpad - full) * k + 32);
    tail = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(padded.data()) + 63) &
                                       ~uintptr_t(63));
    std::fill(tail, tail + (mpad - full) * k, uint16_t(0));
    for (int64_t r = full; r < m; ++r) std::memcpy(tail + (r - full) * k, xs + r * ldx, k * 2);
  }
  auto block_rows = [&](int64_t r, int64_t& ld) -> const uint16_t* {
    ld = r < full ? ldx : k;
    return r < full ? xs + r * ldx : tail + (r - full) * k;
  };
  const int64_t groups = (n + 31) / 32;
  constexpr int64_t GB = kGroup * kBlockBytes[QT];
  const int64_t grouped = n / kGroup * kGroup;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    thread_local std::vector<uint16_t> bt_buf;
    thread_local std::vector<float> row_buf;
    const int64_t bt_elems = kblocks * 1024 + 32;
    bt_buf.resize(static_cast<size_t>(2 * bt_elems));
    uint16_t* bts[2];
    for (int b = 0; b < 2; ++b)
      bts[b] = reinterpret_cast<uint16_t*>(
          (reinterpret_cast<uintptr_t>(bt_buf.data() + b * bt_elems) + 63) & ~uintptr_t(63));
    kvserve::load_tile_config();
    alignas(64) float cbuf[32 * 32];
    // NOTE: software pipelined: group G + 1's tiles are dequantized (vector ALU work) between
    // group G's tile products (AMX work), one k block at a time, so that the two overlap in
    // the out-of-order window instead of taking turns, and group G + 2's bytes are prefetched
    // into L2 meanwhile (a decode step's weights come from DRAM: the K/V it read evicted
    // them). Whole 32-row groups only; a group with plain tail rows is dequantized on its own.
    // Measured on the AMX Xeon (2026-12-04, be68d7a, two threads,
    // bench/probes/amx_quant_layer.py at 25ace60, a layer's four projections in turn over 30
    // layers' weights): 289-318 -> 222-235 us at M = 32, 255-276 -> 184-212 at M = 16, with the
    // one-row-per-lane dequantization above. The prefetch took the bare runner's B=32 decode
    // step from 27.3-27.6 to 25.1-26.1 ms (git show
    // 25ace60:bench/results/session21/weight_prefetch.txt).
    dequant_group<QT>(wp, row_bytes, n, k, g0, bts[0], row_buf);
    for (int64_t G = g0; G < g1; ++G) {
      uint16_t* bt = bts[(G - g0) % 2];
      uint16_t* next = bts[(G - g0 + 1) % 2];
      const bool has_next = G + 1 < g1;
      const bool pipe = has_next && (G + 1) * 32 + 32 <= grouped;
      const uint8_t* next_w = pipe ? wp + (G + 1) * 32 * row_bytes : wp;
      // The group after next, prefetched into L2 over this group's k blocks (its bytes may run
      // past the weight's last row: a prefetch never faults).
      const bool pf_next = G + 2 < g1;
      const char* pf = reinterpret_cast<const char*>(pf_next ? wp + (G + 2) * 32 * row_bytes : wp);
      const int64_t pf_end = pf_next ? 32 * row_bytes : 0;
      const int64_t pf_step = (32 * row_bytes / kblocks + 63) / 64 * 64;
      const int64_t cols = std::min<int64_t>(32, n - G * 32);
      const __mmask32 keep = cols == 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
      for (int64_t r0 = 0; r0 < mpad; r0 += 32) {
        const bool two = mpad - r0 >= 32;
        int64_t ld0 = 0, ld1 = 0;
        const uint16_t* x0 = block_rows(r0, ld0);
        const uint16_t* x1 = two ? block_rows(r0 + 16, ld1) : x0;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < kblocks; ++kb) {
          if (pipe && r0 == 0) {
            for (int64_t b = kb * pf_step; b < std::min(pf_end, (kb + 1) * pf_step); b += 64)
              _mm_prefetch(pf + b, _MM_HINT_T1);
            dequant_btile<QT>(next_w + kb * GB, next + kb * 1024);
            dequant_btile<QT>(next_w + 16 * row_bytes + kb * GB, next + kb * 1024 + 512);
          }
          const uint16_t* b = bt + kb * 1024;
          _tile_loadd(6, b, 64);
          _tile_loadd(7, b + 512, 64);
          _tile_loadd(4, x0 + kb * 32, ld0 * 2);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (two) {
            _tile_loadd(5, x1 + kb * 32, ld1 * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, cbuf, 128);
        _tile_stored(1, cbuf + 16, 128);
        if (two) {
          _tile_stored(2, cbuf + 16 * 32, 128);
          _tile_stored(3, cbuf + 16 * 32 + 16, 128);
        }
        kvserve::store_rows_bf16(cbuf, std::min<int64_t>(32, m - r0), o + r0 * ldo + G * 32, ldo,
                                 keep);
      }
      if (has_next && !pipe) dequant_group<QT>(wp, row_bytes, n, k, G + 1, next, row_buf);
    }
    _tile_release();
  });
}
#endif  // KVQ_HAVE_AMX

}  // namespace

bool amx_bf16_ready() {
#if defined(KVQ_HAVE_AMX)
  return amx_tiles_ready() && isa_supported(kIsaAvx512Vnni);
#else
  return false;
#endif
}

// out [M, N] (bf16, rows contiguous, any row stride) = x [M, K] (bf16) @ dequant(weight)^T,
// weight in the x16 layout.
void quant_amx_bf16_linear(Tensor out, const Tensor& x, const Tensor& weight, int64_t qtype) {
  TORCH_CHECK(amx_bf16_ready(), "kvserve_quant: amx_bf16_linear needs AMX-BF16 (this build or "
              "CPU has none, or the kernel refused the tile state)");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  x.scalar_type() == at::kBFloat16,
              "kvserve_quant: amx_bf16_linear takes a 2-D bfloat16 CPU x with contiguous rows");
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.stride(1) == 1 &&
                  out.scalar_type() == at::kBFloat16,
              "kvserve_quant: amx_bf16_linear writes a 2-D bfloat16 CPU out with contiguous rows");
  check_weight(weight, qtype, x.size(1));
  TORCH_CHECK(!is_kquant(static_cast<int>(qtype)),
              "kvserve_quant: amx_bf16_linear reads q8_0, q4_0 and q4_1 (x16 layout) only");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == weight.size(0),
              "kvserve_quant: out must be [", x.size(0), ", ", weight.size(0), "], got ",
              out.sizes());
  if (x.size(0) == 0) return;
#if defined(KVQ_HAVE_AMX)
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0), rb = weight.size(1);
  if (qtype == kQ8_0) run_amx_bf16<kQ8_0>(xs, x.stride(0), m, k, wp, rb, n, o, out.stride(0));
  if (qtype == kQ4_0) run_amx_bf16<kQ4_0>(xs, x.stride(0), m, k, wp, rb, n, o, out.stride(0));
  if (qtype == kQ4_1) run_amx_bf16<kQ4_1>(xs, x.stride(0), m, k, wp, rb, n, o, out.stride(0));
#endif
}

}  // namespace kvserve_quant
