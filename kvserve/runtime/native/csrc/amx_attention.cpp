// kvserve native AMX prefill attention: a chunk of query rows attends causally over its
// sequence's paged K/V (the context before the chunk and the chunk itself), bf16 on AMX tiles.
//
// Part of the `kvserve` op library (registered in bindings.cpp). Ops:
//   amx_prefill_supported(head_dim) -> bool   this build and CPU run the kernel for head_dim
//   amx_prefill_attention(out, q, kv_cache, block_table, ctx_len, scale) -> ()
//     q, out [n, H, 64] bf16 (rows of any stride, heads and dims contiguous); query row i sits
//     at position ctx_len + i and sees keys 0 .. ctx_len + i;
//     kv_cache [2, blocks, block_size, kvh, 64] bf16, the chunk's own K/V already written;
//     block_table int32, at least ceil((ctx_len + n) / block_size) entries; H % kvh == 0.
//
// Flash attention with the keys as the tiles' rows. The keys' K rows and V^T are first copied
// per KV head into the tile layouts (one pass over the context). Then each task, one query
// head and 16 query rows, walks the keys 32 at a time:
//   S^T [32 keys][16 rows] = K Q^T (AMX, fp32; Q^T packed once per task),
//   the online softmax down the columns (one 16-lane vector per key: the running max and sum
//   of the 16 rows need no horizontal reductions), P^T rounded to bf16 in key pairs,
//   O^T [64 dims][16 rows] += V^T P^T (AMX, fp32), held in four tiles over all the keys;
// out = O / sum, rounded to bf16 once.
// NOTE: why. torch's SDPA (its CPU flash attention) ran the embedded model's prefill chunks
// (9 heads over 3 KV heads, d = 64, bf16) at ~90 GFLOP/s for 128 rows and ~220 for 2048 on
// the AMX Xeon, one thread: attention was about half of a 2048-token prompt's prefill.
// Numerics as SDPA's bf16 path (bf16 products, fp32 sums, P in bf16 for the second product)
// but for two approximations that P's bf16 rounding (relative 3.9e-3) hides: exp2 by a
// degree-4 polynomial (relative error ~4e-5), and the running max raised lazily (below).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__)
#define KVSERVE_AMX_ATTN 1
#include <immintrin.h>

#include "arch/amx_tiles.h"
#endif

#include "ops.h"

namespace kvserve {
namespace {

using at::Tensor;

constexpr int64_t kHeadDim = 64;  // four O^T tiles of 16 dims: with S^T and the operands, all 8

#if defined(KVSERVE_AMX_ATTN)
constexpr int64_t kRows = 16;   // query rows per task (a tile's 16 columns)
constexpr int64_t kKeys = 32;   // keys per step (two S^T tiles; one P^T tile of key pairs)
constexpr int64_t kTile = 512;  // bf16 elements in a 16 x 64-byte tile
// NOTE: the running max is raised only when a step's max passes it by more than this (log2
// units), so most steps rescale nothing: P <= 2^8 then, exact enough in fp32 and in bf16
// (relative precision does not depend on the magnitude). FlashAttention-3's lazy rescaling.
constexpr float kRescale = 8.0f;

// 2^x on 16 lanes for x <= kRescale: 2^n * p(f), n = round(x), f in [-0.5, 0.5], p of degree
// 4 (relative error ~4e-5). x below -126 (a masked -inf included) gives 2^-126; callers zero
// masked lanes.
inline __m512 exp2_16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(9.618129e-3f), f, _mm512_set1_ps(5.550411e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Where a key's K (plane 0) or V (plane 1) row for KV head h lies in the paged cache.
struct PagedKV {
  const uint16_t* cache;
  const int32_t* table;
  int64_t blocks, block_size, kvh;

  const uint16_t* row(int plane, int64_t key, int64_t h) const {
    const int64_t blk = table[key / block_size];
    return cache + (((plane * blocks + blk) * block_size + key % block_size) * kvh + h) * kHeadDim;
  }
};

// Keys [32 g, 32 g + 32) of KV head h: K rows -> kt [32 keys][64] (A tiles: 16 keys, 32
// dims), V^T -> vt [4][16 dims][32 keys] (A tiles of key pairs). Keys at or past len: zeros.
void pack_step(const PagedKV& kv, int64_t h, int64_t g, int64_t len, uint16_t* kt, uint16_t* vt) {
  for (int64_t k = 0; k < kKeys; ++k) {
    const int64_t key = kKeys * g + k;
    const uint16_t* v = key < len ? kv.row(1, key, h) : nullptr;
    if (key < len)
      std::memcpy(kt + k * kHeadDim, kv.row(0, key, h), kHeadDim * 2);
    else
      std::memset(kt + k * kHeadDim, 0, kHeadDim * 2);
    for (int64_t i = 0; i < kHeadDim; ++i) vt[(i / 16) * kTile + (i % 16) * kKeys + k] = v ? v[i] : 0;
  }
}

// Per-thread buffers of one task.
struct alignas(64) TaskScratch {
  uint16_t qt[2 * kTile];       // Q^T: 2 B tiles [16 dim pairs][16 rows][2]
  float s[2][kKeys * kRows];    // S^T of two steps in flight
  uint16_t pt[2][kTile];        // P^T: B tiles [16 key pairs][16 rows][2]
  float o[kRows * 16];          // one O^T tile, stored to rescale or finish
};

// NOTE: tile intrinsics take literal tile numbers (GCC pastes them into the asm): macros.
#define KVSERVE_SCALE_O_TILE(T, buf, a)                                                    \
  do {                                                                                     \
    _tile_stored(T, buf, 64);                                                              \
    for (int i_ = 0; i_ < 16; ++i_)                                                        \
      _mm512_store_ps(buf + 16 * i_, _mm512_mul_ps(_mm512_load_ps(buf + 16 * i_), a));     \
    _tile_loadd(T, buf, 64);                                                               \
  } while (0)

// Out rows [0, nr) dims [dim0, dim0 + 16) from a stored O^T tile [16 dims][16 rows].
void store_out(const float* ot, int64_t dim0, const float* inv, int64_t nr, uint16_t* out,
               int64_t out_ld) {
  for (int64_t r = 0; r < nr; ++r) {
    // Column r of the tile, scaled, rounded to bf16 (RNE) in one vector.
    const __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16)), _mm512_set1_epi32(int(r)));
    const __m512 col = _mm512_mul_ps(_mm512_i32gather_ps(idx, ot, 4), _mm512_set1_ps(inv[r]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_ld + dim0),
                        (__m256i)_mm512_cvtneps_pbh(col));
  }
}

// One query head's rows [r0, r0 + nr) (nr <= 16): their out rows. kpack / vpack: its KV
// head's packed keys and values (pack_step), ctx: the chunk's first position.
void attend_rows(const uint16_t* q, int64_t q_ld, uint16_t* out, int64_t out_ld, int64_t r0,
                 int64_t nr, int64_t ctx, float scale, const uint16_t* kpack,
                 const uint16_t* vpack, TaskScratch& w) {
  auto* qt = reinterpret_cast<uint32_t*>(w.qt);  // element [c][p][r] = Q[r][32 c + 2 p .. + 1]
  for (int64_t c = 0; c < 2; ++c)
    for (int64_t p = 0; p < 16; ++p)
      for (int64_t r = 0; r < kRows; ++r)
        qt[c * 256 + p * 16 + r] =
            r < nr ? reinterpret_cast<const uint32_t*>(q + (r0 + r) * q_ld)[c * 16 + p] : 0u;
  alignas(64) int32_t posv[kRows];  // padding rows take the last row's position
  for (int64_t r = 0; r < kRows; ++r) posv[r] = static_cast<int32_t>(ctx + r0 + std::min(r, nr - 1));
  const __m512i pos = _mm512_load_si512(posv);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 vscale = _mm512_set1_ps(scale * 1.44269504088896341f);  // to log2 units
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  __m512 m = neg_inf, l = _mm512_setzero_ps();  // per row (lane): running max and sum
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t steps = (ctx + r0 + nr - 1 + kKeys) / kKeys;
  // S^T of step kb: tiles 4, 5 (keys 0-15, 16-31), A = K rows (tile 6), B = Q^T (tile 7).
  auto qk = [&](int64_t kb, float* s) {
    const uint16_t* kt = kpack + kb * kKeys * kHeadDim;
    _tile_zero(4);
    _tile_zero(5);
    _tile_loadd(7, w.qt, 64);
    _tile_loadd(6, kt, kHeadDim * 2);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(6, kt + 16 * kHeadDim, kHeadDim * 2);
    _tile_dpbf16ps(5, 6, 7);
    _tile_loadd(7, w.qt + kTile, 64);
    _tile_loadd(6, kt + 32, kHeadDim * 2);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(6, kt + 16 * kHeadDim + 32, kHeadDim * 2);
    _tile_dpbf16ps(5, 6, 7);
    _tile_stored(4, s, 64);
    _tile_stored(5, s + 16 * kRows, 64);
  };
  // O^T (tiles 0-3) += V^T of step kb (A, tile 6) x P^T (B, tile 7).
  auto pv = [&](int64_t kb, const uint16_t* p) {
    const uint16_t* vt = vpack + kb * 4 * kTile;
    _tile_loadd(7, p, 64);
    _tile_loadd(6, vt, 64);
    _tile_dpbf16ps(0, 6, 7);
    _tile_loadd(6, vt + kTile, 64);
    _tile_dpbf16ps(1, 6, 7);
    _tile_loadd(6, vt + 2 * kTile, 64);
    _tile_dpbf16ps(2, 6, 7);
    _tile_loadd(6, vt + 3 * kTile, 64);
    _tile_dpbf16ps(3, 6, 7);
  };
  // Step kb's softmax: S^T in s -> P^T in p (and m, l, O^T rescaled when the max grows).
  auto softmax = [&](int64_t kb, const float* s, uint16_t* p) {
    const int64_t k0 = kb * kKeys;
    const bool full = k0 + kKeys - 1 <= ctx + r0;  // every row sees every key of the step
    __m512 sv[kKeys];
    __m512 bm[4] = {neg_inf, neg_inf, neg_inf, neg_inf};  // four chains, not one
    for (int k = 0; k < kKeys; ++k) {
      __m512 x = _mm512_mul_ps(_mm512_load_ps(s + kRows * k), vscale);
      if (!full) {
        const __mmask16 seen = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(int(k0 + k)));
        x = _mm512_mask_mov_ps(neg_inf, seen, x);
      }
      sv[k] = x;
      bm[k % 4] = _mm512_max_ps(bm[k % 4], x);
    }
    const __m512 top = _mm512_max_ps(_mm512_max_ps(bm[0], bm[1]), _mm512_max_ps(bm[2], bm[3]));
    if (_mm512_cmp_ps_mask(top, _mm512_add_ps(m, _mm512_set1_ps(kRescale)), _CMP_GT_OQ)) {
      const __m512 m_new = _mm512_max_ps(m, top);
      const __mmask16 had = _mm512_cmp_ps_mask(m, neg_inf, _CMP_NEQ_OQ);
      const __m512 alpha = _mm512_maskz_mov_ps(had, exp2_16(_mm512_sub_ps(m, m_new)));
      if (kb > 0) {  // O^T columns (rows' lanes) times alpha; before step 0 O is zero
        KVSERVE_SCALE_O_TILE(0, w.o, alpha);
        KVSERVE_SCALE_O_TILE(1, w.o, alpha);
        KVSERVE_SCALE_O_TILE(2, w.o, alpha);
        KVSERVE_SCALE_O_TILE(3, w.o, alpha);
      }
      l = _mm512_mul_ps(l, alpha);
      m = m_new;
    }
    __m512 sums[2] = {l, _mm512_setzero_ps()};
    for (int kp = 0; kp < kKeys / 2; ++kp) {
      __m512 p0 = exp2_16(_mm512_sub_ps(sv[2 * kp], m));
      __m512 p1 = exp2_16(_mm512_sub_ps(sv[2 * kp + 1], m));
      if (!full) {
        p0 = _mm512_maskz_mov_ps(_mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(int(k0 + 2 * kp))), p0);
        p1 = _mm512_maskz_mov_ps(_mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(int(k0 + 2 * kp + 1))), p1);
      }
      sums[kp % 2] = _mm512_add_ps(sums[kp % 2], _mm512_add_ps(p0, p1));
      // Row kp of the B tile: (key 2 kp, key 2 kp + 1) pairs of each query row.
      _mm512_store_si512(p + 32 * kp, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)));
    }
    l = _mm512_add_ps(sums[0], sums[1]);
  };
  // NOTE: software pipelined: step kb + 2's S^T is issued before step kb's P V and step
  // kb + 1's softmax, so a softmax never waits on the products it reads (their tile stores
  // went out a step earlier) and P^T's stores are done when its tile load reads them (two
  // buffers each). Hand-interleaving the tile ops into the softmax's loops measured the same.
  qk(0, w.s[0]);
  if (steps > 1) qk(1, w.s[1]);
  softmax(0, w.s[0], w.pt[0]);
  for (int64_t kb = 0; kb < steps; ++kb) {
    if (kb + 2 < steps) qk(kb + 2, w.s[kb % 2]);
    pv(kb, w.pt[kb % 2]);
    if (kb + 1 < steps) softmax(kb + 1, w.s[(kb + 1) % 2], w.pt[(kb + 1) % 2]);
  }
  alignas(64) float inv[kRows];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
  uint16_t* dst = out + r0 * out_ld;
  _tile_stored(0, w.o, 64);
  store_out(w.o, 0, inv, nr, dst, out_ld);
  _tile_stored(1, w.o, 64);
  store_out(w.o, 16, inv, nr, dst, out_ld);
  _tile_stored(2, w.o, 64);
  store_out(w.o, 32, inv, nr, dst, out_ld);
  _tile_stored(3, w.o, 64);
  store_out(w.o, 48, inv, nr, dst, out_ld);
}

#endif  // KVSERVE_AMX_ATTN

}  // namespace

bool amx_prefill_supported(int64_t head_dim) {
#if defined(KVSERVE_AMX_ATTN)
  return head_dim == kHeadDim && amx_tiles_granted();
#else
  static_cast<void>(head_dim);
  return false;
#endif
}

void amx_prefill_attention(Tensor out, Tensor q, Tensor kv_cache, Tensor block_table,
                           int64_t ctx_len, double scale) {
  TORCH_CHECK(q.device().is_cpu() && out.device().is_cpu() && kv_cache.device().is_cpu() &&
                  block_table.device().is_cpu(),
              "amx_prefill_attention: tensors must be on CPU");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                  kv_cache.scalar_type() == at::kBFloat16,
              "amx_prefill_attention: q, out and kv_cache must be bfloat16");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "amx_prefill_attention: kv_cache must be a contiguous [2, blocks, block_size, "
              "kvh, d] tensor");
  const int64_t d = kv_cache.size(4), kvh = kv_cache.size(3), bs = kv_cache.size(2);
  TORCH_CHECK(amx_prefill_supported(d), "amx_prefill_attention: needs AMX-BF16 (this build or "
              "CPU has none) and head_dim ", kHeadDim, ", got ", d);
  TORCH_CHECK(q.dim() == 3 && q.size(2) == d && q.stride(2) == 1 && q.stride(1) == d,
              "amx_prefill_attention: q must be [n, H, ", d, "] with contiguous heads");
  const int64_t n = q.size(0), heads = q.size(1);
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.stride(1) == d,
              "amx_prefill_attention: out must be shaped like q with contiguous heads");
  TORCH_CHECK(heads % kvh == 0, "amx_prefill_attention: ", heads, " heads over ", kvh,
              " KV heads");
  TORCH_CHECK(ctx_len >= 0, "amx_prefill_attention: ctx_len must be >= 0");
  const int64_t len = ctx_len + n;
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 1 &&
                  block_table.is_contiguous() && block_table.size(0) * bs >= len,
              "amx_prefill_attention: block_table must be a contiguous int32 vector covering ",
              len, " keys");
  if (n == 0) return;
#if defined(KVSERVE_AMX_ATTN)
  const int32_t* table = block_table.data_ptr<int32_t>();
  for (int64_t b = 0; b < (len + bs - 1) / bs; ++b)
    TORCH_CHECK(table[b] >= 0 && table[b] < kv_cache.size(1),
                "amx_prefill_attention: block id ", table[b], " out of range");
  const PagedKV kv{reinterpret_cast<const uint16_t*>(kv_cache.data_ptr()), table,
                   kv_cache.size(1), bs, kvh};
  const int64_t steps = (len + kKeys - 1) / kKeys;
  const int64_t k_elems = steps * kKeys * kHeadDim, v_elems = steps * 4 * kTile;  // per KV head
  thread_local std::vector<uint16_t> packed;
  packed.resize(static_cast<size_t>(kvh * (k_elems + v_elems)) + 32);
  // 64-byte aligned: tile rows then never straddle cache lines.
  uint16_t* kpack = reinterpret_cast<uint16_t*>(
      (reinterpret_cast<uintptr_t>(packed.data()) + 63) & ~uintptr_t(63));
  uint16_t* vpack = kpack + kvh * k_elems;
  at::parallel_for(0, kvh * steps, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / steps, g = i % steps;
      pack_step(kv, h, g, len, kpack + h * k_elems + g * kKeys * kHeadDim,
                vpack + h * v_elems + g * 4 * kTile);
    }
  });
  // Tasks: (row block, head), row blocks in the order 0, last, 1, last - 1, ...: a block's
  // cost grows with its position (causal), so each contiguous share of the tasks that
  // at::parallel_for hands a thread has about the same work.
  const int64_t row_blocks = (n + kRows - 1) / kRows, group = heads / kvh;
  const auto* qs = reinterpret_cast<const uint16_t*>(q.data_ptr());
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, row_blocks * heads, 1, [&](int64_t begin, int64_t end) {
    load_tile_config();
    thread_local TaskScratch w;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t j = i / heads, head = i % heads;
      const int64_t rb = j % 2 == 0 ? j / 2 : row_blocks - 1 - j / 2;
      const int64_t r0 = rb * kRows, nr = std::min(kRows, n - r0), h = head / group;
      attend_rows(qs + head * d, q.stride(0), os + head * d, out.stride(0), r0, nr, ctx_len,
                  fscale, kpack + h * k_elems, vpack + h * v_elems, w);
    }
    _tile_release();
  });
#endif
}

}  // namespace kvserve
