// kvserve native CPU kernels: the per-layer ops around the weight matmuls of a decode step.
//
// Registered as torch custom ops in the `kvserve` namespace (torch.ops.kvserve.*), CPU only;
// Python-side fake kernels (kvserve/runtime/native/__init__.py) let FakeTensorMode trace
// them. Every op writes into tensors the caller owns and returns nothing: the model's
// Workspace keeps all activations, so a step allocates nothing here either.
//
// NOTE: why native code at all. A decode step of the embedded model at B=1 was ~27 ms of
// weight matmuls that stream 538 MB from DRAM and ~13 ms of everything else: ~34 small aten
// ops per layer (RMSNorm alone is 7), each paying dispatch plus a cold start after the
// matmul has flushed the caches. Each op here replaces several of those with one pass over
// the data. At B=32 the torch decode attention first gathers every sequence's blocks into a
// padded copy and then runs SDPA over it; `paged_decode_attention` reads the blocks where
// they lie, once.
//
// Numerics: float accumulation for every dtype (double for RMSNorm's sum of squares); results
// differ from the torch path only by summation order and by `exp_approx` (relative error
// 8.4e-8 at most over [-87, 88], checked against double exp in steps of 1e-4; ATen's
// vectorized exp is within 1 ulp, 1.2e-7). Decode attention's bf16 q . k on AVX512_BF16 CPUs
// (vdpbf16ps) also flushes products below 2^-126 to 0.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvserve {
namespace {

using at::Tensor;

// Cephes-style expf: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p(r) = 1 + r + r^2 P(r)
// with P of degree 5. Pure arithmetic and integer bit tricks, so `#pragma omp simd` loops
// vectorize it (libm's expf is a scalar call). Inputs are clamped to [-87.34, 88.38]: below,
// the result is exp(-87.34) ~ 1.2e-38, the smallest normal float, instead of a denormal.
// Its constants, shared with its vector forms (exp16, exp8): the clamp, log2(e), ln2 split in
// two so that n * ln2 is subtracted without rounding loss, and P's coefficients, highest first.
constexpr float kExpMin = -87.33654f, kExpMax = 88.37626f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_approx(float x) {
  x = std::min(std::max(x, kExpMin), kExpMax);
  const float n = std::nearbyint(x * kLog2e);
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = p * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  // NOTE: n = -127 (x near -88) would carry into the sign bit; such terms are 0 in float.
  return n < -126.0f ? 0.0f : out;
}

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

// NOTE: bf16 <-> float by bit operations, branch-free: c10::BFloat16's own conversions
// (an isnan branch, calls through its operators) kept `#pragma omp simd` loops scalar, which
// made the bf16 kernels 10-12x slower than the float ones (silu_mul of [32, 2 x 1536]: 250 vs
// 21 us, one thread). Same results bit for bit: round to nearest even, NaN -> 0x7FC0.
template <>
inline float to_float<c10::BFloat16>(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}

template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
}

// Rows of at least this many elements of work run in parallel; below it the OpenMP fork
// costs more than it saves (a decode step's rows at B=1 are 576-1536 elements).
constexpr int64_t kParallelWork = 1 << 15;

inline int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kParallelWork / std::max<int64_t>(1, work_per_item));
}

void check_cpu(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "kvserve native op: ", name, " must be a CPU tensor");
}

void check_rows(const Tensor& t, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, "kvserve native op: ", name,
              " must be 2-D with contiguous rows, got sizes ", t.sizes(), " strides ",
              t.strides());
}

// One row of add_rms_norm: h += r (if r), o = (h * rsqrt(mean(h^2) + eps)) * w.
// NOTE: the loops live outside AT_DISPATCH's macro argument, where a #pragma cannot go.
template <typename scalar_t>
void rms_row(scalar_t* h, const scalar_t* r, const scalar_t* w, scalar_t* o, int64_t n,
             float eps) {
  // NOTE: the sum of squares in double: the float mean then carries one rounding, where
  // float sums in any lane order (torch's or ours) carry several. This scale multiplies
  // every element of the row and the error grows through the layers: on a 140-token prompt
  // of the embedded model a float sum put the logits 4.8e-3 from a float64 run, this
  // 9.7e-4 (transformers in float32: 7.1e-4; kvserve's torch ops: 1.8e-4).
  // NOTE: the add and the sum of squares in two loops: one loop mixing 16-bit stores with a
  // double reduction stayed scalar for bf16 (35 us vs 8 us for a [32, 576] add + norm).
  if (r != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) h[i] = from_float<scalar_t>(to_float(h[i]) + to_float(r[i]));
  }
  double sumsq = 0.0;
#pragma omp simd reduction(+ : sumsq)
  for (int64_t i = 0; i < n; ++i) sumsq += static_cast<double>(to_float(h[i])) * to_float(h[i]);
  const float mean = static_cast<float>(sumsq / static_cast<double>(n));
  const float scale = 1.0f / std::sqrt(mean + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    o[i] = from_float<scalar_t>((to_float(h[i]) * scale) * to_float(w[i]));
  }
}

// One token of rope_: heads rows of d, cos/sin rows c/s of d.
template <typename scalar_t>
void rope_row(scalar_t* x, const scalar_t* c, const scalar_t* s, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t hd = 0; hd < heads; ++hd) {
    scalar_t* lo = x + hd * d;
    scalar_t* hi = lo + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float xl = to_float(lo[i]), xh = to_float(hi[i]);
      lo[i] = from_float<scalar_t>(xl * to_float(c[i]) + xh * to_float(s[i]));
      hi[i] = from_float<scalar_t>(xh * to_float(c[half + i]) + xl * to_float(s[half + i]));
    }
  }
}

// Rotate-half RoPE in place on x [T, heads, d] (rows may be strided; heads contiguous).
// cos, sin: [T, 1, d] contiguous, sin's first half negated (see rope_cos_sin in llama.py).
void rope_(Tensor x, Tensor cos, Tensor sin) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x must be [T, heads, d] with contiguous heads, got strides ", x.strides());
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == rows * d &&
                  sin.numel() == rows * d,
              "cos and sin must be contiguous [T, 1, d]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos and sin must have x's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rope_", [&] {
    scalar_t* base = x.data_ptr<scalar_t>();
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0);
    at::parallel_for(0, rows, grain_for(heads * d), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        rope_row<scalar_t>(base + t * xs, c + t * d, s + t * d, heads, d);
      }
    });
  });
}

// Write k, v [T, kvh, d] (rows may be strided; each row contiguous) into cache
// [2, num_blocks, block_size, kvh, d] at flat slots slot_mapping[T].
template <typename scalar_t>
void write_kv_impl(scalar_t* cache, int64_t slots_per_plane, const Tensor& k, const Tensor& v,
                   const int64_t* slots, int64_t rows, int64_t row_elems) {
  const scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* vp = v.data_ptr<scalar_t>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  const size_t nbytes = static_cast<size_t>(row_elems) * sizeof(scalar_t);
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t slot = slots[t];
    TORCH_CHECK(slot >= 0 && slot < slots_per_plane, "slot ", slot, " out of range [0, ",
                slots_per_plane, ")");
    std::memcpy(cache + slot * row_elems, kp + t * ks, nbytes);
    std::memcpy(cache + (slots_per_plane + slot) * row_elems, vp + t * vs, nbytes);
  }
}

void check_cache(const Tensor& cache) {
  check_cpu(cache, "kv_cache");
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, block_size, kvh, d] tensor");
}

void check_kv_rows(const Tensor& x, const Tensor& cache, const char* name) {
  check_cpu(x, name);
  TORCH_CHECK(x.dim() == 3 && x.size(1) == cache.size(3) && x.size(2) == cache.size(4) &&
                  x.stride(2) == 1 && x.stride(1) == x.size(2),
              name, " must be [T, kvh, d] with contiguous rows matching the cache");
  TORCH_CHECK(x.scalar_type() == cache.scalar_type(), name, " must have the cache's dtype");
}

void write_kv(Tensor kv_cache, Tensor k, Tensor v, Tensor slot_mapping) {
  check_cache(kv_cache);
  check_kv_rows(k, kv_cache, "k");
  check_kv_rows(v, kv_cache, "v");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == k.size(0) && v.size(0) == k.size(0),
              "slot_mapping must be a contiguous int64 [T] tensor matching k and v");
  const int64_t slots_per_plane = kv_cache.size(1) * kv_cache.size(2);
  const int64_t row_elems = kv_cache.size(3) * kv_cache.size(4);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, kv_cache.scalar_type(), "write_kv",
                                  [&] {
    write_kv_impl<scalar_t>(kv_cache.data_ptr<scalar_t>(), slots_per_plane, k, v,
                            slot_mapping.data_ptr<int64_t>(), k.size(0), row_elems);
  });
}

// Visible positions of a query at seq_len - 1: [0, r1_end) u [r2_begin, seq_len); without a
// window that is all of [0, seq_len), with a window W and S sinks [0, S) u [L - W, L).
struct Visible {
  int64_t r1_end, r2_begin;
  // How many positions of a sequence of seq_len are visible.
  int64_t count(int64_t seq_len) const { return r1_end + (seq_len - r2_begin); }
};

inline Visible visible_ranges(int64_t seq_len, int64_t window, int64_t sinks) {
  if (window <= 0 || seq_len <= window) return {seq_len, seq_len};
  const int64_t r1_end = std::min(sinks, seq_len);
  return {r1_end, std::max(seq_len - window, r1_end)};
}

// Calls f(j, row, n) for each run of n visible positions that lie in one block, in order:
// j counts visible positions from 0, row points at the run's first [kvh, d] row in `plane`
// (the next rows follow at a stride of kvh * d). With `prefetch_to` != 0, each run's rows
// `prefetch_to` elements further on (the other plane) and the next run's rows are
// prefetched while f works on this one (the portable kernels of decode_seq; the wide ones
// of decode_seq_wide, AVX-512 or AVX2, stream their lines instead: LineStream).
// NOTE: a run is at most one block (12 KB of K for the embedded model in fp32, 6 in bf16),
// in whatever order the allocator gave out blocks: too short for the hardware prefetcher to
// ramp up on. At B=32 the K/V of a layer come cold from DRAM (the weight stream evicted
// them). The prefetches go to L2 (prefetcht1), not L1: a block's 200 lines at once overflow
// L1's miss buffers. Zen 4, bench/probes/attn_cold.py --threads 2 --huge-pages, alternating:
// 884-894 -> 729-746 us a layer on random blocks, 771-773 -> 649-667 on sequential ones; two
// blocks ahead instead of one was slower (755).
template <typename scalar_t, typename F>
inline void for_each_visible_run(const scalar_t* plane, const int32_t* table, int64_t block_size,
                                 int64_t row_elems, Visible vis, int64_t seq_len,
                                 int64_t prefetch_to, F&& f) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);  // elements per cache line
  auto prefetch = [&](const scalar_t* from, int64_t n) {
    for (int64_t e = 0; e < n * row_elems; e += kLine) __builtin_prefetch(from + e, 0, 2);
  };
  int64_t j = 0;
  for (const auto [lo, hi] : {std::pair<int64_t, int64_t>{0, vis.r1_end},
                              std::pair<int64_t, int64_t>{vis.r2_begin, seq_len}}) {
    for (int64_t pos = lo; pos < hi;) {
      const int64_t off = pos % block_size;
      const int64_t n = std::min(block_size - off, hi - pos);
      const scalar_t* row = plane + (table[pos / block_size] * block_size + off) * row_elems;
      if (prefetch_to != 0) {
        prefetch(row + prefetch_to, n);
        const int64_t next = pos + n;
        if (next < hi) {
          const int64_t next_n = std::min(block_size, hi - next);
          prefetch(plane + table[next / block_size] * block_size * row_elems, next_n);
        }
      }
      f(j, row, n);
      pos += n;
      j += n;
    }
  }
}

// A LineStream's reach: at most this many lines past what its reader has read, and at most
// this many lines a pump (the K pass pumps every 8 key rows of a head, the V pass every row).
// NOTE: bench/probes/attn_cold.py --huge-pages --threads 2 --len 192, session 22 (the AMX
// Xeon): 256, 512 or 1024 lines ahead all took 260-303 us a layer at 4 a pump (325-329
// before); 2 a pump fell behind the reader (438-487 us), 8 a pump 283-303.
constexpr int64_t kStreamAhead = 512;
constexpr int64_t kPumpLines = 4;

// The cache lines one thread's decode attention tasks read, in the order they read them (a
// task's K rows, then its V rows, then the next task's), prefetched into L2 a few at a time
// from inside the kernels' loops (`pump`), at most kStreamAhead lines past what they have
// read (`consumed`, reported a kv head's rows at a time). The caller pushes each task's runs
// one task ahead of the one it runs (`push`, `begin_task`), so the stream holds at most two
// tasks' runs; a stream that fell behind the reader skips to the task it begins.
// NOTE: why. Prefetching a block's ~200 K and V lines at once, as for_each_visible_run does,
// left a step's cold read and its arithmetic one after the other: a third q . k pass added
// its hot cost in full to the cold one (bench/results/session22/attn_overlap.txt). A burst
// of prefetches fills the L1's miss buffers (a prefetch to L2 takes one too), and the loads
// behind it wait. On a synthetic stream (bench/probes/prefetch_overlap.cpp) prefetches of 32
// lines at a time overlapped none of the read with the arithmetic, 8 or 1 at a time most.
class LineStream {
 public:
  // `rows` rows of `span` contiguous lines each, `stride` bytes apart, from `first`.
  struct Run {
    const char* first;
    int64_t span, stride, rows;
  };

  // Room for two tasks' runs of up to `max_runs` each (kvserve/runtime/kernel_scratch.py
  // counts it).
  explicit LineStream(int64_t max_runs) { runs_.reserve(static_cast<size_t>(2 * max_runs)); }

  // Appends the runs of the task after those pushed so far.
  void push(const std::vector<Run>& task_runs) {
    for (const Run& r : task_runs) pushed_lines_ += r.span * r.rows;
    runs_.insert(runs_.end(), task_runs.begin(), task_runs.end());
  }

  // The reader begins the oldest pushed task it has not begun: the runs before it go.
  void begin_task() {
    if (issued_ < task_line_) {  // behind the reader: skip to this task's first line
      next_ = task_run_;
      left_ = rows_left_ = 0;
      issued_ = task_line_;
    }
    runs_.erase(runs_.begin(), runs_.begin() + task_run_);
    next_ -= task_run_;
    task_run_ = static_cast<int64_t>(runs_.size());  // where the next push starts
    task_line_ = pushed_lines_;
  }

  // The reader has read `lines` more lines of the stream.
  void consumed(int64_t lines) { consumed_ += lines; }

  // Prefetches up to `n` more lines, never more than kStreamAhead past what was read.
  __attribute__((always_inline)) inline void pump(int64_t n) {
    n = std::min(n, consumed_ + kStreamAhead - issued_);
    for (; n > 0; --n) {
      if (left_ == 0) {
        if (rows_left_ > 0) {
          row_ += stride_;
          --rows_left_;
        } else {
          if (next_ >= static_cast<int64_t>(runs_.size())) return;
          const Run& r = runs_[next_++];
          row_ = r.first;
          span_ = r.span;
          stride_ = r.stride;
          rows_left_ = r.rows - 1;
        }
        at_ = row_;
        left_ = span_;
      }
      __builtin_prefetch(at_, 0, 2);
      at_ += 64;
      --left_;
      ++issued_;
    }
  }

 private:
  std::vector<Run> runs_;
  int64_t next_ = 0, consumed_ = 0, issued_ = 0, pushed_lines_ = 0;
  // The first run and line of the task the reader begins next.
  int64_t task_run_ = 0, task_line_ = 0;
  // The cursor: the line, the lines left in its row, the row and the rows left in its run.
  const char* at_ = nullptr;
  const char* row_ = nullptr;
  int64_t left_ = 0, span_ = 0, stride_ = 0, rows_left_ = 0;
};

// scores[r] = q . k_r for n key rows k_r = k + r * stride (d floats each).
// NOTE: four rows per loop: four independent FMA chains. One dot product alone is a chain
// of d / 8 dependent FMAs plus a horizontal sum, latency-bound at ~4x this loop's time.
template <typename scalar_t>
inline void dot_rows(const float* q, const scalar_t* k, int64_t stride, int64_t n, int64_t d,
                     float* scores) {
  int64_t r = 0;
  for (; r + 4 <= n; r += 4) {
    const scalar_t* k0 = k + r * stride;
    const scalar_t* k1 = k0 + stride;
    const scalar_t* k2 = k1 + stride;
    const scalar_t* k3 = k2 + stride;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t i = 0; i < d; ++i) {
      s0 += q[i] * to_float(k0[i]);
      s1 += q[i] * to_float(k1[i]);
      s2 += q[i] * to_float(k2[i]);
      s3 += q[i] * to_float(k3[i]);
    }
    scores[r] = s0;
    scores[r + 1] = s1;
    scores[r + 2] = s2;
    scores[r + 3] = s3;
  }
  for (; r < n; ++r) {
    const scalar_t* kr = k + r * stride;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < d; ++i) s += q[i] * to_float(kr[i]);
    scores[r] = s;
  }
}

// acc += sum_r p[r] * v_r for n value rows v_r = v + r * stride (d floats each).
template <typename scalar_t>
inline void axpy_rows(const float* p, const scalar_t* v, int64_t stride, int64_t n, int64_t d,
                      float* acc) {
  int64_t r = 0;
  for (; r + 4 <= n; r += 4) {
    const scalar_t* v0 = v + r * stride;
    const scalar_t* v1 = v0 + stride;
    const scalar_t* v2 = v1 + stride;
    const scalar_t* v3 = v2 + stride;
    const float p0 = p[r], p1 = p[r + 1], p2 = p[r + 2], p3 = p[r + 3];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) {
      acc[i] += (p0 * to_float(v0[i]) + p1 * to_float(v1[i])) +
                (p2 * to_float(v2[i]) + p3 * to_float(v3[i]));
    }
  }
  for (; r < n; ++r) {
    const scalar_t* vr = v + r * stride;
    const float pr = p[r];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) acc[i] += pr * to_float(vr[i]);
  }
}

// float32 / bfloat16 fast path: the `G` query heads of one KV head against several key/value
// rows at once, in GCC vector extensions (8 floats; the compiler maps them to
// AVX2/AVX-512/NEON). bf16 K/V rows are widened to float on load (exact: bf16 is the top half
// of a float), so both dtypes accumulate in float in the same order.
// NOTE: one head at a time (dot_rows) loads each K chunk for one FMA; G heads x R rows load
// R + G chunks for R x G FMAs, and R x G independent accumulators hide the FMA latency.
typedef float v8f __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

inline v8f load8(const c10::BFloat16* p) {
  v8u16 h;
  std::memcpy(&h, p, sizeof(h));
  const v8u32 w = __builtin_convertvector(h, v8u32) << 16;
  v8f v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

inline float hsum8(v8f v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// scores[g * sstride + r] = q_g . k_r for g < G, n rows k_r = k + r * stride; d % 8 == 0.
template <int G, typename kv_t>
void dot_group(const float* q, const kv_t* k, int64_t stride, int64_t n, int64_t d,
                   float* scores, int64_t sstride) {
  constexpr int R = G <= 4 ? 4 : 2;
  int64_t r = 0;
  for (; r + R <= n; r += R) {
    v8f acc[G][R] = {};
    for (int64_t i = 0; i < d; i += 8) {
      v8f kv[R];
      for (int j = 0; j < R; ++j) kv[j] = load8(k + (r + j) * stride + i);
      for (int g = 0; g < G; ++g) {
        const v8f qv = load8(q + g * d + i);
        for (int j = 0; j < R; ++j) acc[g][j] += qv * kv[j];
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int j = 0; j < R; ++j) scores[g * sstride + r + j] = hsum8(acc[g][j]);
    }
  }
  for (; r < n; ++r) {
    v8f acc[G] = {};
    for (int64_t i = 0; i < d; i += 8) {
      const v8f kv = load8(k + r * stride + i);
      for (int g = 0; g < G; ++g) acc[g] += load8(q + g * d + i) * kv;
    }
    for (int g = 0; g < G; ++g) scores[g * sstride + r] = hsum8(acc[g]);
  }
}

// acc[g] += sum_r p[g * pstride + r] * v_r for g < G, n rows v_r = v + r * stride; d % 8 == 0.
template <int G, typename kv_t>
void axpy_group(const float* p, int64_t pstride, const kv_t* v, int64_t stride, int64_t n,
                    int64_t d, float* acc) {
  for (int64_t i = 0; i < d; i += 8) {
    // NOTE: two accumulators per head (even and odd rows): twice the independent chains.
    v8f a[G], b[G];
    for (int g = 0; g < G; ++g) {
      a[g] = load8(acc + g * d + i);
      b[g] = v8f{};
    }
    int64_t r = 0;
    for (; r + 2 <= n; r += 2) {
      const v8f v0 = load8(v + r * stride + i);
      const v8f v1 = load8(v + (r + 1) * stride + i);
      for (int g = 0; g < G; ++g) {
        a[g] += p[g * pstride + r] * v0;
        b[g] += p[g * pstride + r + 1] * v1;
      }
    }
    if (r < n) {
      const v8f v0 = load8(v + r * stride + i);
      for (int g = 0; g < G; ++g) a[g] += p[g * pstride + r] * v0;
    }
    for (int g = 0; g < G; ++g) {
      const v8f sum = a[g] + b[g];
      std::memcpy(acc + g * d + i, &sum, sizeof(sum));
    }
  }
}

template <typename kv_t>
struct GroupKernels {
  void (*dot)(const float*, const kv_t*, int64_t, int64_t, int64_t, float*, int64_t);
  void (*axpy)(const float*, int64_t, const kv_t*, int64_t, int64_t, int64_t, float*);
};

// The group kernels for `group` query heads per KV head (nullptr: none).
template <typename kv_t>
inline const GroupKernels<kv_t>* group_kernels(int64_t group, int64_t d) {
  static const GroupKernels<kv_t> table[] = {
      {dot_group<1, kv_t>, axpy_group<1, kv_t>}, {dot_group<2, kv_t>, axpy_group<2, kv_t>},
      {dot_group<3, kv_t>, axpy_group<3, kv_t>}, {dot_group<4, kv_t>, axpy_group<4, kv_t>},
      {dot_group<5, kv_t>, axpy_group<5, kv_t>}, {dot_group<6, kv_t>, axpy_group<6, kv_t>},
      {dot_group<7, kv_t>, axpy_group<7, kv_t>}, {dot_group<8, kv_t>, axpy_group<8, kv_t>},
  };
  return group >= 1 && group <= 8 && d % 8 == 0 ? &table[group - 1] : nullptr;
}

template <typename scalar_t>
constexpr bool kHasGroupKernels =
    std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>;

// The largest of n scores.
// NOTE: a max in any lane order is the same max. Written with std::max (and without the
// pragma) this loop stayed scalar, one dependent vmaxss per score: ~1.6 us per sequence of
// the embedded model (9 heads x 170 scores), as much as its AVX-512 V pass.
inline float row_max(const float* sq, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t t = 0; t < n; ++t) m = sq[t] > m ? sq[t] : m;
  return m;
}

// sq[t] /= sum for n exponentials.
// NOTE: normalize the probabilities, not the output: the same rounding as softmax.
inline void normalize_row(float* sq, int64_t n, float sum) {
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) sq[t] *= inv;
}

// Softmax of each of the nq rows of scores [nq, n] in place (float, max-subtracted).
inline void softmax_rows(float* scores, int64_t nq, int64_t n) {
  for (int64_t iq = 0; iq < nq; ++iq) {
    float* sq = scores + iq * n;
    const float m = row_max(sq, n);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      const float e = exp_approx(sq[t] - m);
      sq[t] = e;
      sum += e;
    }
    normalize_row(sq, n, sum);
  }
}

// The wide attention kernels of one shape (decode_seq_wide): `dot` scores up to kWideRows key
// rows for a kv head's query heads, `axpy` adds a run of value rows to their accumulators.
template <typename q_t, typename kv_t>
struct AttnKernels {
  void (*dot)(const q_t*, const kv_t* const*, int64_t, int64_t, int64_t, float, float*, int64_t,
              LineStream&);
  void (*axpy)(const float*, int64_t, const kv_t*, int64_t, int64_t, int64_t, float*,
               LineStream&);
};

#if defined(__AVX512F__)
// AVX-512 path (float32 / bfloat16, d % 32 == 0, 1-8 heads per KV head): 16-float vectors,
// the scores of 16 key rows reduced together instead of one horizontal sum each, and the
// softmax's exponentials 16 at a time.
// NOTE: why. The v8f kernels above compile to AVX2 width, and hsum8 costs ~7 shuffles and
// adds per score, about as much as the score's FMAs. On the embedded model (G = 3, d = 64,
// bf16, 170 tokens, one thread, K/V in L2) a sequence took 12.4 us with them (K pass 5.6, V
// pass 3.5, softmax and prefetches 3.2) and takes 6.2 us here (2.5, 1.6, 2.1).

// 32 elements as two 16-float halves: float32 as they lie ([0, 16) and [16, 32)); bfloat16
// as its even and odd elements, widened by a shift and a mask (exact, like to_float), which
// is cheaper than an in-order widening (a lane-crossing shuffle per 16 elements).
// Accumulators and float queries of this path are kept in that "split" order.
inline void load32(const float* p, __m512& lo, __m512& hi) {
  lo = _mm512_loadu_ps(p);
  hi = _mm512_loadu_ps(p + 16);
}

inline void load32(const c10::BFloat16* p, __m512& lo, __m512& hi) {
  const __m512i x = _mm512_loadu_si512(p);  // bf16 pairs: element 2i low, 2i + 1 high
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// split[32] (load32's order for kv_t) -> out[32] in element order.
template <typename kv_t>
inline void unsplit32(const float* split, float* out) {
  if constexpr (std::is_same_v<kv_t, float>) {
    std::memcpy(out, split, 32 * sizeof(float));
  } else {
    const __m512 even = _mm512_loadu_ps(split), odd = _mm512_loadu_ps(split + 16);
    const __m512i first =
        _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    _mm512_storeu_ps(out, _mm512_permutex2var_ps(even, first, odd));
    _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(even, second, odd));
  }
}

// acc + q . k over 32 elements: q float in load32's order for kv_t, k as stored.
template <typename kv_t>
inline __m512 dot32(__m512 acc, const float* q, const kv_t* k) {
  __m512 lo, hi;
  load32(k, lo, hi);
  acc = _mm512_fmadd_ps(_mm512_loadu_ps(q), lo, acc);
  return _mm512_fmadd_ps(_mm512_loadu_ps(q + 16), hi, acc);
}

#if defined(__AVX512BF16__)
// bf16 q and k: vdpbf16ps, acc[i] += q[2i] k[2i] + q[2i+1] k[2i+1] in float. A bf16 product
// is exact in float, so this is the float FMA path in another summation order (inputs and
// results below 2^-126 flush to 0).
// NOTE: vdpbf16ps runs at half the rate of a float FMA here (one per 2 cycles), but saves
// widening K: 5.4 us per sequence of the embedded model, 6.2 with load32 and two FMAs.
// Widening each K row once for all G heads (partial sums through the stack) was slower.
inline __m512 dot32(__m512 acc, const c10::BFloat16* q, const c10::BFloat16* k) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q), (__m512bh)_mm512_loadu_si512(k));
}

template <typename kv_t>
using WideQuery = kv_t;  // bf16 queries go to vdpbf16ps as they are
#else
template <typename kv_t>
using WideQuery = float;
#endif

// exp_approx on 16 lanes, the same operations in the same order (GCC contracts the scalar
// code's `a * b + c` into these FMAs), so the same results bit for bit: checked over
// [-100, 100] in steps of 1e-4 and at +-0, +-inf and NaN.
// NOTE: why not `#pragma omp simd` over exp_approx: GCC turns its clamps and final select into
// mask-register juggling (~40 instructions per 8 floats); this is ~20 per 16.
inline __m512 exp16(__m512 x) {
  // max(lo, x) and min(hi, x) return x when x is NaN, like std::max(x, lo) and std::min.
  x = _mm512_min_ps(_mm512_set1_ps(kExpMax), _mm512_max_ps(_mm512_set1_ps(kExpMin), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  // NOTE: p * 2^n in one vscalefps instead of exp_approx's exponent-bits add, its n < -126
  // select and the float -> int conversion (4 of ~20 instructions; silu_mul's [32, 1536] bf16
  // row set 28 -> 26 us, one thread, bench/probes/silu_variants.cpp). Same bits: after the
  // clamp n >= -126 and r > 0 at n = -126, so p * 2^n is a normal float, which the bits add
  // builds exactly too.
  return _mm512_scalef_ps(p, n);
}

// softmax_rows with exp16: the exponentials summed in 16 lanes instead of the compiler's 8.
inline void softmax_rows_wide(float* scores, int64_t nq, int64_t n) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (n % 16)) - 1);
  const int64_t full = n - n % 16;
  for (int64_t iq = 0; iq < nq; ++iq) {
    float* sq = scores + iq * n;
    const __m512 mv = _mm512_set1_ps(row_max(sq, n));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < full; t += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sq + t), mv));
      _mm512_storeu_ps(sq + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (tail != 0) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sq + full), mv));
      _mm512_mask_storeu_ps(sq + full, tail, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
    }
    normalize_row(sq, n, _mm512_reduce_add_ps(sum));
  }
}

// Lane i of the result: the sum of v[i]'s 16 lanes (16 horizontal sums at once, in 15
// shuffles, 15 blends and 15 adds). Each level halves the width: for each pair (a, b) the
// blend keeps a's low and b's high part and the shuffle brings a's high and b's low part,
// so the sum holds a's partial sums in its low and b's in its high parts.
inline __m512 sum16(const __m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i) {  // 256-bit halves: x[i] = [v[i] | v[i + 8]]
    const __m512 a = v[i], b = v[i + 8];
    x[i] = _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, a, b),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 3, 2)));
  }
  const __m512i swap128 =
      _mm512_setr_epi32(4, 5, 6, 7, 16, 17, 18, 19, 12, 13, 14, 15, 24, 25, 26, 27);
  for (int i = 0; i < 4; ++i) {  // 128-bit quarters
    const __m512 a = x[i], b = x[i + 4];
    y[i] = _mm512_add_ps(_mm512_mask_blend_ps(0xF0F0, a, b),
                         _mm512_permutex2var_ps(a, swap128, b));
  }
  for (int i = 0; i < 2; ++i) {  // 64-bit pairs
    const __m512d a = _mm512_castps_pd(y[i]), b = _mm512_castps_pd(y[i + 2]);
    z[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_mask_blend_pd(0xAA, a, b)),
                         _mm512_castpd_ps(_mm512_shuffle_pd(a, b, 0x55)));
  }
  const __m512i swap32 =
      _mm512_setr_epi32(1, 16, 3, 18, 5, 20, 7, 22, 9, 24, 11, 26, 13, 28, 15, 30);
  return _mm512_add_ps(_mm512_mask_blend_ps(0xAAAA, z[0], z[1]),
                       _mm512_permutex2var_ps(z[0], swap32, z[1]));
}

// scores[g * sstride + r] = scale * q_g . k_r for g < G and r < n, k_r = rows[r] + off;
// rows: 16 pointers, those past the first n repeat an earlier row (their scores are dropped).
// q: [G, d], float in load32's order or bf16 as stored (WideQuery).
// NOTE: head by head, 16 rows at a time: 16 independent accumulators in registers, then one
// sum16. The K rows (16 x d) are read G times, from L1. No branch on n in the loops: with
// one (`if (r < n)`), GCC kept the accumulators on the stack.
template <int G, typename q_t, typename kv_t>
void dot_group16(const q_t* q, const kv_t* const* rows, int64_t off, int64_t n, int64_t d,
                 float scale, float* scores, int64_t sstride, LineStream& lines) {
  const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
  for (int g = 0; g < G; ++g) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 32) {
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) {
        acc[r] = dot32(acc[r], q + g * d + i, rows[r] + off + i);
        if (r % 8 == 7) lines.pump(kPumpLines);
      }
    }
    const __m512 s = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(scores + g * sstride, mask, s);
  }
}

// acc[g] += sum_r p[g * pstride + r] * v_r for g < G, n rows v_r = v + r * stride.
// acc: [G, d] float in load32's order; d % (32 C) == 0.
// NOTE: 32 C columns per pass over the rows (C = 2 reads a d = 64 row's 128 bytes in one
// pass, C = 1 half of it in each of two), with 2 C G accumulators, doubled (even and odd
// rows) when there are 8 or fewer, to have enough independent FMA chains.
template <int G, int C, typename kv_t>
void axpy_group16(const float* p, int64_t pstride, const kv_t* v, int64_t stride, int64_t n,
                  int64_t d, float* acc, LineStream& lines) {
  constexpr int K = 2 * C;  // float vectors per pass and head
  constexpr int S = K * G <= 8 ? 2 : 1;
  for (int64_t i = 0; i < d; i += 32 * C) {
    __m512 a[S][G][K];
    for (int g = 0; g < G; ++g) {
      for (int k = 0; k < K; ++k) {
        a[0][g][k] = _mm512_loadu_ps(acc + g * d + i + 16 * k);
        for (int s = 1; s < S; ++s) a[s][g][k] = _mm512_setzero_ps();
      }
    }
    auto row = [&](int s, int64_t r) {
      __m512 x[K];
      for (int c = 0; c < C; ++c) load32(v + r * stride + i + 32 * c, x[2 * c], x[2 * c + 1]);
      for (int g = 0; g < G; ++g) {
        const __m512 pg = _mm512_set1_ps(p[g * pstride + r]);
        for (int k = 0; k < K; ++k) a[s][g][k] = _mm512_fmadd_ps(pg, x[k], a[s][g][k]);
      }
    };
    int64_t r = 0;
    for (; r + S <= n; r += S) {
      lines.pump(kPumpLines);
      for (int s = 0; s < S; ++s) row(s, r + s);
    }
    for (; r < n; ++r) row(0, r);
    for (int g = 0; g < G; ++g) {
      for (int k = 0; k < K; ++k) {
        for (int s = 1; s < S; ++s) a[0][g][k] = _mm512_add_ps(a[0][g][k], a[s][g][k]);
        _mm512_storeu_ps(acc + g * d + i + 16 * k, a[0][g][k]);
      }
    }
  }
}

template <typename kv_t>
using WideKernels = AttnKernels<WideQuery<kv_t>, kv_t>;

// The AVX-512 kernels for `group` query heads per KV head (nullptr: none).
template <typename kv_t>
inline const WideKernels<kv_t>* wide_kernels(int64_t group, int64_t d) {
  using q_t = WideQuery<kv_t>;
  static const WideKernels<kv_t> table[] = {
      {dot_group16<1, q_t, kv_t>, axpy_group16<1, 1, kv_t>},
      {dot_group16<2, q_t, kv_t>, axpy_group16<2, 1, kv_t>},
      {dot_group16<3, q_t, kv_t>, axpy_group16<3, 1, kv_t>},
      {dot_group16<4, q_t, kv_t>, axpy_group16<4, 1, kv_t>},
      {dot_group16<5, q_t, kv_t>, axpy_group16<5, 1, kv_t>},
      {dot_group16<6, q_t, kv_t>, axpy_group16<6, 1, kv_t>},
      {dot_group16<7, q_t, kv_t>, axpy_group16<7, 1, kv_t>},
      {dot_group16<8, q_t, kv_t>, axpy_group16<8, 1, kv_t>},
  };
  // d % 64 == 0: the V pass takes 64 columns at a time for groups of up to 4 heads.
  static const WideKernels<kv_t> table64[] = {
      {dot_group16<1, q_t, kv_t>, axpy_group16<1, 2, kv_t>},
      {dot_group16<2, q_t, kv_t>, axpy_group16<2, 2, kv_t>},
      {dot_group16<3, q_t, kv_t>, axpy_group16<3, 2, kv_t>},
      {dot_group16<4, q_t, kv_t>, axpy_group16<4, 2, kv_t>},
  };
  if (group < 1 || group > 8 || d % 32 != 0) return nullptr;
  return group <= 4 && d % 64 == 0 ? &table64[group - 1] : &table[group - 1];
}

// Rows the K pass scores at a time (dot_group16).
constexpr int64_t kWideRows = 16;

// n query elements (n % 32 == 0) as float in load32's order, for dot32.
template <typename scalar_t>
inline void wide_queries(const scalar_t* q, float* qf, int64_t n) {
  for (int64_t i = 0; i < n; i += 32) {
    __m512 lo, hi;
    load32(q + i, lo, hi);
    _mm512_storeu_ps(qf + i, lo);
    _mm512_storeu_ps(qf + i + 16, hi);
  }
}

// acc [n] float in load32's order -> out [n] in element order, rounded to scalar_t.
template <typename scalar_t>
inline void wide_store(const float* acc, scalar_t* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 32) {
    float chunk[32];
    unsplit32<scalar_t>(acc + i, chunk);
    for (int e = 0; e < 32; ++e) out[i + e] = from_float<scalar_t>(chunk[e]);
  }
}
#define KVSERVE_WIDE_ATTN 1
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 path (float32 / bfloat16, d % 8 == 0, 1-8 heads per KV head; the AVX2-only CPUs, such
// as Zen 3): decode_seq_wide's passes on 8-float vectors. The scores of 8 key rows are
// reduced together (sum8) instead of one horizontal sum each (hsum8 of the portable kernels,
// ~7 operations a score, as many as the score's FMAs at d = 64), the softmax's exponentials
// 8 at a time (exp8), and the reads streamed as on AVX-512 (LineStream). Queries and
// accumulators stay in element order: bf16 widens in order with one vpmovzxwd.

// Rows the K pass scores at a time (dot_group8).
constexpr int64_t kWideRows = 8;

template <typename kv_t>
using WideQuery = float;

inline __m256 load8f(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8f(const c10::BFloat16* p) {  // exact, like to_float
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// Lane i of the result: the sum of v[i]'s 8 lanes (6 vhaddps, 2 vperm2f128, 1 add).
inline __m256 sum8(const __m256* v) {
  // t: pair sums of two vectors per 128-bit lane; u: their quad sums, v[0..3] low / high half.
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// exp_approx on 8 lanes, its operations in its order (p * 2^n by the exponent-bits add).
// NOTE: no n < -126 select: after the clamp n >= -126 (exp16's note).
inline __m256 exp8(__m256 x) {
  // max(lo, x) and min(hi, x) return x when x is NaN, like std::max(x, lo) and std::min.
  x = _mm256_min_ps(_mm256_set1_ps(kExpMax), _mm256_max_ps(_mm256_set1_ps(kExpMin), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

// The lanes of an 8-wide step with `left` elements left: all 8, or the first `left`.
inline __m256i tail_mask8(int64_t left) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(left, 8))),
                            lane);
}

// softmax_rows with exp8 (the exponentials summed in 8 lanes).
inline void softmax_rows_wide(float* scores, int64_t nq, int64_t n) {
  const int64_t full = n - n % 8;
  const __m256i tail = tail_mask8(n % 8);
  for (int64_t iq = 0; iq < nq; ++iq) {
    float* sq = scores + iq * n;
    const __m256 mv = _mm256_set1_ps(row_max(sq, n));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < full; t += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sq + t), mv));
      _mm256_storeu_ps(sq + t, e);
      sum = _mm256_add_ps(sum, e);
    }
    if (full < n) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_maskload_ps(sq + full, tail), mv));
      _mm256_maskstore_ps(sq + full, tail, e);
      sum = _mm256_add_ps(sum, _mm256_and_ps(e, _mm256_castsi256_ps(tail)));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, sum);
    normalize_row(sq, n, hsum8(load8(lanes)));
  }
}

// scores[g * sstride + r] = scale * q_g . k_r for g < G and r < n, k_r = rows[r] + off;
// rows: 8 pointers, those past the first n repeat an earlier row (their scores are dropped).
// q: [G, d] float. NOTE: dot_group16's shape at half the width: head by head, 8 rows at a
// time, 8 accumulators, then one sum8.
template <int G, typename kv_t>
void dot_group8(const float* q, const kv_t* const* rows, int64_t off, int64_t n, int64_t d,
                float scale, float* scores, int64_t sstride, LineStream& lines) {
  const __m256i mask = tail_mask8(n);
  for (int g = 0; g < G; ++g) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + g * d + i);
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(qv, load8f(rows[r] + off + i), acc[r]);
      if (i % 16 == 8) lines.pump(kPumpLines);
    }
    const __m256 s = _mm256_mul_ps(sum8(acc), _mm256_set1_ps(scale));
    _mm256_maskstore_ps(scores + g * sstride, mask, s);
  }
}

// acc[g] += sum_r p[g * pstride + r] * v_r for g < G, n rows v_r = v + r * stride.
// acc: [G, d] float; d % (8 K) == 0. NOTE: 8 K columns per pass over the rows with K G
// accumulators, doubled (even and odd rows) while they fit 12 of the 16 ymm registers.
template <int G, int K, typename kv_t>
void axpy_group8(const float* p, int64_t pstride, const kv_t* v, int64_t stride, int64_t n,
                 int64_t d, float* acc, LineStream& lines) {
  constexpr int S = 2 * K * G <= 12 ? 2 : 1;
  for (int64_t i = 0; i < d; i += 8 * K) {
    __m256 a[S][G][K];
    for (int g = 0; g < G; ++g) {
      for (int k = 0; k < K; ++k) {
        a[0][g][k] = _mm256_loadu_ps(acc + g * d + i + 8 * k);
        for (int s = 1; s < S; ++s) a[s][g][k] = _mm256_setzero_ps();
      }
    }
    auto row = [&](int s, int64_t r) {
      __m256 x[K];
      for (int k = 0; k < K; ++k) x[k] = load8f(v + r * stride + i + 8 * k);
      for (int g = 0; g < G; ++g) {
        const __m256 pg = _mm256_broadcast_ss(p + g * pstride + r);
        for (int k = 0; k < K; ++k) a[s][g][k] = _mm256_fmadd_ps(pg, x[k], a[s][g][k]);
      }
    };
    int64_t r = 0;
    for (; r + S <= n; r += S) {
      lines.pump(kPumpLines);
      for (int s = 0; s < S; ++s) row(s, r + s);
    }
    for (; r < n; ++r) row(0, r);
    for (int g = 0; g < G; ++g) {
      for (int k = 0; k < K; ++k) {
        for (int s = 1; s < S; ++s) a[0][g][k] = _mm256_add_ps(a[0][g][k], a[s][g][k]);
        _mm256_storeu_ps(acc + g * d + i + 8 * k, a[0][g][k]);
      }
    }
  }
}

// 8 floats -> 8 bf16 words rounded as from_float rounds (nearest even, NaN -> 0x7FC0).
inline __m128i bf16_words8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb);
  __m256i words = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  words = _mm256_blendv_epi8(words, _mm256_set1_epi32(0x7FC0), nan);
  // Packed per 128-bit lane: words 0-3 in quadword 0, 4-7 in quadword 2.
  const __m256i packed = _mm256_packus_epi32(words, words);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

inline __m256 round8(__m256 v, float) { return v; }  // to float's precision: itself

inline __m256 round8(__m256 v, c10::BFloat16) {  // to bf16's precision and back
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_words8(v)), 16));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

inline void store8(c10::BFloat16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_words8(v));
}

// silu_mul_row on 8 lanes with exp8: the scalar row's operations in its order, so the same
// results bit for bit. The row's tail runs through the same code on a zero-padded copy.
// NOTE: why. The scalar row's `omp simd` loop took [32, 1536] in 176-178 us (fp32) and
// 328-343 (bf16) on one thread of an x86-64-v3 build, 26 and 70 here (the AMX Xeon,
// bench/results/session24/layer_ops_avx2_ab.txt): ~3 ms of a fp32 B=32 step of the
// embedded model on two threads, ~7 % of a 512-token prefill chunk (~0.68 s there).
#define KVSERVE_AVX2_SILU 1
template <typename scalar_t>
void silu_mul_row_wide(const scalar_t* gu, scalar_t* o, int64_t inter) {
  const scalar_t* u = gu + inter;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 one = _mm256_set1_ps(1.0f);
  auto step = [&](const scalar_t* g8, const scalar_t* u8, scalar_t* o8) {
    const __m256 x = load8f(g8);
    const __m256 e = exp8(_mm256_xor_ps(x, sign));
    const __m256 silu = round8(_mm256_div_ps(x, _mm256_add_ps(one, e)), scalar_t{});
    store8(o8, _mm256_mul_ps(silu, load8f(u8)));
  };
  int64_t i = 0;
  for (; i + 8 <= inter; i += 8) step(gu + i, u + i, o + i);
  if (i < inter) {
    const size_t left = static_cast<size_t>(inter - i) * sizeof(scalar_t);
    scalar_t g8[8], u8[8], o8[8];
    std::memset(g8, 0, sizeof(g8));
    std::memset(u8, 0, sizeof(u8));
    std::memcpy(g8, gu + i, left);
    std::memcpy(u8, u + i, left);
    step(g8, u8, o8);
    std::memcpy(o + i, o8, left);
  }
}

template <typename kv_t>
using WideKernels = AttnKernels<float, kv_t>;

// The AVX2 kernels for `group` query heads per KV head (nullptr: none).
template <typename kv_t>
inline const WideKernels<kv_t>* wide_kernels(int64_t group, int64_t d) {
  static const WideKernels<kv_t> table[] = {
      {dot_group8<1, kv_t>, axpy_group8<1, 1, kv_t>},
      {dot_group8<2, kv_t>, axpy_group8<2, 1, kv_t>},
      {dot_group8<3, kv_t>, axpy_group8<3, 1, kv_t>},
      {dot_group8<4, kv_t>, axpy_group8<4, 1, kv_t>},
      {dot_group8<5, kv_t>, axpy_group8<5, 1, kv_t>},
      {dot_group8<6, kv_t>, axpy_group8<6, 1, kv_t>},
      {dot_group8<7, kv_t>, axpy_group8<7, 1, kv_t>},
      {dot_group8<8, kv_t>, axpy_group8<8, 1, kv_t>},
  };
  // d % 16 == 0: the V pass takes 16 columns at a time for groups of up to 3 heads.
  static const WideKernels<kv_t> table16[] = {
      {dot_group8<1, kv_t>, axpy_group8<1, 2, kv_t>},
      {dot_group8<2, kv_t>, axpy_group8<2, 2, kv_t>},
      {dot_group8<3, kv_t>, axpy_group8<3, 2, kv_t>},
  };
  if (group < 1 || group > 8 || d % 8 != 0) return nullptr;
  return group <= 3 && d % 16 == 0 ? &table16[group - 1] : &table[group - 1];
}

template <typename scalar_t>
inline void wide_queries(const scalar_t* q, float* qf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) qf[i] = to_float(q[i]);
}

template <typename scalar_t>
inline void wide_store(const float* acc, scalar_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = from_float<scalar_t>(acc[i]);
}
#define KVSERVE_WIDE_ATTN 1
#endif  // __AVX512F__ / __AVX2__

#if defined(KVSERVE_WIDE_ATTN)
// decode_seq (below) with the wide kernels (AVX-512 or AVX2): the same passes and buffers. The
// softmax scale multiplies the float scores (vdpbf16ps takes the bf16 queries as they are).
template <typename scalar_t>
void decode_seq_wide(const WideKernels<scalar_t>& wide, const scalar_t* q, scalar_t* out,
                     const scalar_t* k_plane, const scalar_t* v_plane, const int32_t* table,
                     int64_t seq_len, int64_t block_size, int64_t kvh, int64_t h0, int64_t h1,
                     int64_t group, int64_t d, float scale, int64_t window, int64_t sinks,
                     std::vector<float>& buf, LineStream& lines) {
  using q_t = WideQuery<scalar_t>;
  const int64_t head_lines = d * static_cast<int64_t>(sizeof(scalar_t)) / 64;
  const Visible vis = visible_ranges(seq_len, window, sinks);
  const int64_t n_vis = vis.count(seq_len);
  const int64_t nq = (h1 - h0) * group;
  buf.resize(static_cast<size_t>(nq * (n_vis + 2 * d)));
  float* scores = buf.data();        // [nq, n_vis]
  float* acc = scores + nq * n_vis;  // [nq, d] in the kernels' order (wide_queries)
  const q_t* qk;                     // [nq, d] the queries as the dot kernel takes them
  if constexpr (std::is_same_v<q_t, scalar_t>) {
    qk = q + h0 * group * d;
  } else {
    float* qf = acc + nq * d;
    wide_queries(q + h0 * group * d, qf, nq * d);
    qk = qf;
  }
  const int64_t row_elems = kvh * d;
  // NOTE: the K pass takes kWideRows visible rows at a time, across blocks: a block size
  // under that or a window boundary inside a block costs no partial groups but the
  // sequence's last.
  const scalar_t* rows[kWideRows];  // [kvh, d] rows of visible positions j0 .. j0 + count - 1
  int64_t j0 = 0, count = 0;
  auto score_rows = [&] {
    for (int64_t r = count; r < kWideRows; ++r) rows[r] = rows[count - 1];
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t iq = (h - h0) * group;
      wide.dot(qk + iq * d, rows, h * d, count, d, scale, scores + iq * n_vis + j0, n_vis,
               lines);
      lines.consumed(count * head_lines);
    }
    j0 += count;
    count = 0;
  };
  for_each_visible_run(k_plane, table, block_size, row_elems, vis, seq_len, 0,
                       [&](int64_t, const scalar_t* row, int64_t n) {
    for (int64_t r = 0; r < n; ++r) {
      rows[count++] = row + r * row_elems;
      if (count == kWideRows) score_rows();
    }
  });
  if (count > 0) score_rows();
  softmax_rows_wide(scores, nq, n_vis);
  std::fill(acc, acc + nq * d, 0.0f);
  for_each_visible_run(v_plane, table, block_size, row_elems, vis, seq_len, 0,
                       [&](int64_t j, const scalar_t* row, int64_t n) {
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t iq = (h - h0) * group;
      wide.axpy(scores + iq * n_vis + j, n_vis, row + h * d, row_elems, n, d, acc + iq * d,
                lines);
      lines.consumed(n * head_lines);
    }
  });
  wide_store(acc, out + h0 * group * d, nq * d);
}
#endif  // KVSERVE_WIDE_ATTN

#if defined(__AVX512F__)

#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVSERVE_WIDE_SILU 1
// silu_mul_row on 16 lanes with exp16, the same operations as the scalar row (float and
// bfloat16), so the same results bit for bit; the row's tail runs masked, so a result does
// not depend on where in a row an element lies.
// NOTE: why. `#pragma omp simd` over the scalar row ran at ~1 G elements/s a thread (the
// clamps and selects of exp_approx, see exp16), slower than torch's two passes (F.silu,
// then a multiply): [512, 1536] took 392 us on 2 threads, torch 327.
// The lanes of a 16-wide step with `left` elements left in the row: all 16, or the first `left`.
inline __mmask16 tail_mask16(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

template <typename scalar_t>
inline __m512 load16(const scalar_t* p, __mmask16 m);

template <>
inline __m512 load16<float>(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}

template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p, __mmask16 m) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));  // exact, like to_float
}

// from_float<bfloat16> on 16 lanes: round to nearest even, NaN -> 0x7FC0.
inline __m512i bf16_bits16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb);
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC0));
}

template <typename scalar_t>
inline __m512 round16(__m512 v);  // to scalar_t's precision and back

template <>
inline __m512 round16<float>(__m512 v) {
  return v;
}

// NOTE: with AVX512_BF16, vcvtneps2bf16 rounds to nearest even in one instruction where
// bf16_bits16 takes six (silu_mul's [32, 1536] bf16 rows 35 -> 28 us, one thread,
// bench/probes/silu_variants.cpp). Same bits
// but for NaN (a quiet NaN keeping its sign, not 0x7FC0) and denormals (flushed to zero:
// the instruction ignores MXCSR), which no activation of a real model reaches.
#if defined(__AVX512BF16__)
inline __m256i bf16_words16(__m512 v) {
  return (__m256i)_mm512_cvtneps_pbh(v);
}
#else
inline __m256i bf16_words16(__m512 v) {
  return _mm512_cvtepi32_epi16(bf16_bits16(v));
}
#endif

template <>
inline __m512 round16<c10::BFloat16>(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_words16(v)), 16));
}

template <typename scalar_t>
inline void store16(scalar_t* p, __mmask16 m, __m512 v);

template <>
inline void store16<float>(float* p, __mmask16 m, __m512 v) {
  _mm512_mask_storeu_ps(p, m, v);
}

template <>
inline void store16<c10::BFloat16>(c10::BFloat16* p, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(p, m, bf16_words16(v));
}

template <typename scalar_t>
void silu_mul_row_wide(const scalar_t* gu, scalar_t* o, int64_t inter) {
  const scalar_t* u = gu + inter;
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < inter; i += 16) {
    const __mmask16 m = tail_mask16(inter - i);
    const __m512 x = load16(gu + i, m);
    const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign));
    const __m512 silu = round16<scalar_t>(_mm512_div_ps(x, _mm512_add_ps(one, exp16(neg))));
    store16(o + i, m, _mm512_mul_ps(silu, load16(u + i, m)));
  }
}

// rms_row on 16 lanes: the same operations (the add rounded once, squares summed in double,
// the scale applied as (h * scale) * w), so the same results (bf16 NaN and denormal bits
// aside, see bf16_words16): the double sum of a row's squares is exact for bf16 rows in any
// order, and for float rows its order changes it by ~1e-16, below the float mean's rounding.
// The tail runs masked (zeros add nothing).
// NOTE: why. GCC's `omp simd` loops kept one double accumulator (a 4-cycle FMA chain) and
// rounded with six integer instructions per 16 values: a [32, 576] bf16 call took 11.3-12.2
// us from Python, one thread, and takes 8.2-8.6 with four accumulators and vcvtneps2bf16
// (bench/results/session23/layer_ops_probe_ab.txt).
template <typename scalar_t>
void rms_row_wide(scalar_t* h, const scalar_t* r, const scalar_t* w, scalar_t* o, int64_t n,
                  float eps) {
  __m512d acc[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(),
                    _mm512_setzero_pd()};
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask16(n - i);
    __m512 x = load16(h + i, m);
    if (r != nullptr) {
      x = round16<scalar_t>(_mm512_add_ps(x, load16(r + i, m)));
      store16(h + i, m, x);  // x is already at scalar_t's precision: stored exactly
    }
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1));
    const int a = (i / 16) % 2 * 2;
    acc[a] = _mm512_fmadd_pd(lo, lo, acc[a]);
    acc[a + 1] = _mm512_fmadd_pd(hi, hi, acc[a + 1]);
  }
  const double sumsq = _mm512_reduce_add_pd(
      _mm512_add_pd(_mm512_add_pd(acc[0], acc[1]), _mm512_add_pd(acc[2], acc[3])));
  const float mean = static_cast<float>(sumsq / static_cast<double>(n));
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask16(n - i);
    store16(o + i, m, _mm512_mul_ps(_mm512_mul_ps(load16(h + i, m), scale), load16(w + i, m)));
  }
}
#endif  // __AVX512BW__ && __AVX512VL__
#endif  // __AVX512F__

// Whether decode_seq takes the wide kernels (decode_seq_wide, AVX-512 or AVX2) for this shape.
template <typename scalar_t>
bool uses_wide_kernels(int64_t group, int64_t d) {
#if defined(KVSERVE_WIDE_ATTN)
  if constexpr (kHasGroupKernels<scalar_t>) return wide_kernels<scalar_t>(group, d) != nullptr;
#endif
  return false;
}

// Most LineStream runs of one task of paged_decode_attention: one a plane and block, and a
// block more where a window's gap splits one.
inline int64_t max_task_runs(int64_t max_blocks) { return 2 * (max_blocks + 1); }

// The LineStream runs of one task of paged_decode_attention (kv heads [h0, h0 + heads) of
// sequence b): its visible rows' K lines, then their V lines, one run a block, in the order
// decode_seq_wide reads them.
template <typename scalar_t>
void task_runs(const scalar_t* k_plane, const scalar_t* v_plane, const int32_t* table,
               int64_t seq_len, int64_t block_size, int64_t row_elems, int64_t d, int64_t h0,
               int64_t heads, int64_t window, int64_t sinks,
               std::vector<LineStream::Run>& runs) {
  const int64_t row_bytes = row_elems * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t span = heads * d * static_cast<int64_t>(sizeof(scalar_t)) / 64;  // a row's lines
  const bool whole = span * 64 == row_bytes;  // the task's rows follow one another
  const Visible vis = visible_ranges(seq_len, window, sinks);
  runs.clear();
  for (const scalar_t* plane : {k_plane, v_plane}) {
    for_each_visible_run(plane, table, block_size, row_elems, vis, seq_len, 0,
                         [&](int64_t, const scalar_t* row, int64_t n) {
      const char* at = reinterpret_cast<const char*>(row + h0 * d);
      if (whole) {
        runs.push_back({at, n * span, 0, 1});
      } else {
        runs.push_back({at, span, row_bytes, n});
      }
    });
  }
}

// Decode attention of one sequence for kv heads [h0, h1): each kv head's `group` query heads
// attend over the visible positions, read in place from the cache blocks. Where the wide
// kernels (AVX-512 or AVX2) take the shape (decode_seq_wide), they do; the choice depends on
// the model only, so a sequence's result does not depend on the batch it is in or on the
// thread count.
template <typename scalar_t>
void decode_seq(const scalar_t* q,        // [H, d] this sequence's query heads
                scalar_t* out,            // [H, d]
                const scalar_t* k_plane,  // cache[0] as [num_blocks * block_size, kvh, d]
                const scalar_t* v_plane,  // cache[1]
                const int32_t* table, int64_t seq_len, int64_t block_size, int64_t kvh,
                int64_t h0, int64_t h1, int64_t group, int64_t d, float scale, int64_t window,
                int64_t sinks, std::vector<float>& buf, LineStream& lines) {
#if defined(KVSERVE_WIDE_ATTN)
  if constexpr (kHasGroupKernels<scalar_t>) {
    if (const WideKernels<scalar_t>* wide = wide_kernels<scalar_t>(group, d)) {
      decode_seq_wide<scalar_t>(*wide, q, out, k_plane, v_plane, table, seq_len, block_size,
                                kvh, h0, h1, group, d, scale, window, sinks, buf, lines);
      return;
    }
  }
#endif
  const Visible vis = visible_ranges(seq_len, window, sinks);
  const int64_t n_vis = vis.count(seq_len);
  const int64_t nq = (h1 - h0) * group;  // query heads handled here
  buf.resize(static_cast<size_t>(nq * (n_vis + 2 * d)));
  float* scores = buf.data();         // [nq, n_vis]
  float* acc = scores + nq * n_vis;   // [nq, d]
  float* qf = acc + nq * d;           // [nq, d] queries, pre-scaled, in float
  const scalar_t* q0 = q + h0 * group * d;
  for (int64_t i = 0; i < nq * d; ++i) qf[i] = to_float(q0[i]) * scale;
  const int64_t row_elems = kvh * d;
  // NOTE: the K pass prefetches the V rows too: the V pass then reads them from L2.
  const GroupKernels<scalar_t>* fast = nullptr;
  if constexpr (kHasGroupKernels<scalar_t>) fast = group_kernels<scalar_t>(group, d);
  for_each_visible_run(k_plane, table, block_size, row_elems, vis, seq_len, v_plane - k_plane,
                       [&](int64_t j, const scalar_t* row, int64_t n) {
    if constexpr (kHasGroupKernels<scalar_t>) {
      if (fast != nullptr) {
        for (int64_t h = h0; h < h1; ++h) {
          const int64_t iq = (h - h0) * group;
          fast->dot(qf + iq * d, row + h * d, row_elems, n, d, scores + iq * n_vis + j, n_vis);
        }
        return;
      }
    }
    for (int64_t iq = 0; iq < nq; ++iq) {
      const int64_t h = h0 + iq / group;
      dot_rows(qf + iq * d, row + h * d, row_elems, n, d, scores + iq * n_vis + j);
    }
  });
  softmax_rows(scores, nq, n_vis);
  std::fill(acc, acc + nq * d, 0.0f);
  for_each_visible_run(v_plane, table, block_size, row_elems, vis, seq_len, 0,
                       [&](int64_t j, const scalar_t* row, int64_t n) {
    if constexpr (kHasGroupKernels<scalar_t>) {
      if (fast != nullptr) {
        for (int64_t h = h0; h < h1; ++h) {
          const int64_t iq = (h - h0) * group;
          fast->axpy(scores + iq * n_vis + j, n_vis, row + h * d, row_elems, n, d, acc + iq * d);
        }
        return;
      }
    }
    for (int64_t iq = 0; iq < nq; ++iq) {
      const int64_t h = h0 + iq / group;
      axpy_rows(scores + iq * n_vis + j, row + h * d, row_elems, n, d, acc + iq * d);
    }
  });
  scalar_t* o0 = out + h0 * group * d;
  for (int64_t i = 0; i < nq * d; ++i) o0[i] = from_float<scalar_t>(acc[i]);
}

// A task's fixed cost in units of visible positions (the query's load, the softmax's
// normalisation and the output's store), so that many short sequences weigh something.
constexpr int64_t kTaskOverheadPositions = 16;

// Bounds of `parts` contiguous ranges of [0, tasks) of about equal work (work(i) >= 0 for
// task i): range p is [bounds[p], bounds[p + 1]), bounds[0] = 0, bounds[parts] = tasks.
// NOTE: why not at::parallel_for's even split by count: a step's rows are not alike. Its
// decode rows come ordered by context length and its prompt chunks' rows grow one position
// each, so halving by count left one thread with most of the reading (a recorded ShareGPT
// step at B=31: 2.0x the other's positions; the layer's call took 1.22-1.35x as long as for
// the same positions spread evenly, bench/results/session18/attn_cold_ab.txt).
template <typename WorkFn>
std::vector<int64_t> balanced_bounds(int64_t tasks, int64_t parts, WorkFn work) {
  parts = std::max<int64_t>(1, std::min(parts, tasks));
  std::vector<int64_t> prefix(static_cast<size_t>(tasks) + 1, 0);
  for (int64_t i = 0; i < tasks; ++i) prefix[i + 1] = prefix[i] + work(i);
  std::vector<int64_t> bounds(static_cast<size_t>(parts) + 1, tasks);
  bounds[0] = 0;
  for (int64_t p = 1; p < parts; ++p) {
    // The task boundary nearest p / parts of the work (compared as parts * prefix against
    // p * total, in integers), never before the last one: a range may be empty when one task
    // outweighs a part.
    const int64_t goal = prefix[tasks] * p;
    int64_t i = std::lower_bound(prefix.begin() + bounds[p - 1], prefix.end(),
                                 (goal + parts - 1) / parts) - prefix.begin();
    if (i > bounds[p - 1] && goal - parts * prefix[i - 1] < parts * prefix[i] - goal) --i;
    bounds[p] = std::min<int64_t>(tasks, i);
  }
  return bounds;
}

// Decode attention for B single-token queries straight from the paged cache.
// q: [B, H, d] (rows may be strided, heads contiguous); out: [B, H, d] contiguous;
// block_tables: [B, max_blocks] int32 (entries past a sequence's length are never read);
// seq_lens: [B] int32, each query at position seq_len - 1. sliding_window 0 = none.
void paged_decode_attention(Tensor out, Tensor q, Tensor kv_cache, Tensor block_tables,
                            Tensor seq_lens, double scale, int64_t sliding_window,
                            int64_t num_sink_tokens) {
  check_cache(kv_cache);
  check_cpu(q, "q");
  check_cpu(out, "out");
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kvh = kv_cache.size(3), block_size = kv_cache.size(2);
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == d,
              "q must be [B, H, d] with contiguous heads");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous like q");
  TORCH_CHECK(d == kv_cache.size(4) && heads % kvh == 0, "q's heads/head_dim don't fit the cache");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() &&
                  out.scalar_type() == kv_cache.scalar_type(),
              "q, out and kv_cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == batch,
              "block_tables must be a contiguous int32 [B, max_blocks] tensor");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.numel() == batch,
              "seq_lens must be a contiguous int32 [B] tensor");
  const int64_t max_blocks = block_tables.size(1), num_blocks = kv_cache.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  int64_t total_len = 0;
  std::vector<int64_t> seq_work(static_cast<size_t>(batch));  // visible positions + overhead
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size, "seq_lens[", b, "] = ",
                lens[b], " does not fit ", max_blocks, " blocks of ", block_size);
    // NOTE: only blocks holding visible positions are read: a block freed out of the window
    // (-1 in the table) may sit between the sinks and the window.
    const Visible vis = visible_ranges(lens[b], sliding_window, num_sink_tokens);
    const auto [r1_end, r2_begin] = vis;
    seq_work[b] = vis.count(lens[b]) + kTaskOverheadPositions;
    for (const auto [lo, hi] : {std::pair<int64_t, int64_t>{0, r1_end},
                                std::pair<int64_t, int64_t>{r2_begin, lens[b]}}) {
      if (lo >= hi) continue;
      for (int64_t i = lo / block_size; i <= (hi - 1) / block_size; ++i) {
        const int32_t blk = tables[b * max_blocks + i];
        TORCH_CHECK(blk >= 0 && blk < num_blocks, "block_tables[", b, ", ", i, "] = ", blk,
                    " is visible but not a block of the cache (", num_blocks, " blocks)");
      }
    }
    total_len += lens[b];
  }
  const int64_t group = heads / kvh;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(),
                                  "paged_decode_attention", [&] {
    const scalar_t* k_plane = kv_cache.data_ptr<scalar_t>();
    const scalar_t* v_plane = k_plane + kv_cache.stride(0);
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t qs = q.stride(0);
    // NOTE: a task is a whole sequence (its blocks read front to back, all heads) when there
    // are enough sequences to keep every thread busy and none holds more than a thread's
    // share of the positions; else one kv head of one sequence (a head's output is the same
    // either way, bit for bit).
    const int64_t threads = at::get_num_threads();
    int64_t total_work = 0, max_work = 0;
    for (const int64_t w : seq_work) {
      total_work += w;
      max_work = std::max(max_work, w);
    }
    const bool whole = batch >= 2 * threads && max_work * threads <= total_work;
    const int64_t heads_per_task = whole ? kvh : 1;
    const int64_t per_seq = kvh / heads_per_task;
    const int64_t tasks = batch * per_seq;
    const int64_t work_per_task =
        std::max<int64_t>(1, total_len / batch) * heads_per_task * group * d * 2;
    const int64_t grain = grain_for(work_per_task);
    const int64_t parts = std::min<int64_t>(threads, (tasks + grain - 1) / grain);
    const std::vector<int64_t> bounds =
        balanced_bounds(tasks, parts, [&](int64_t task) { return seq_work[task / per_seq]; });
    const bool stream = uses_wide_kernels<scalar_t>(group, d);
    at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
      std::vector<float> buf;
      LineStream lines(stream ? max_task_runs(max_blocks) : 0);
      std::vector<LineStream::Run> runs;  // one task's
      if (stream) runs.reserve(static_cast<size_t>(max_task_runs(max_blocks)));
      auto push_task = [&](int64_t task) {
        if (!stream || task >= bounds[p1]) return;
        const int64_t b = task / per_seq;
        task_runs(k_plane, v_plane, tables + b * max_blocks, lens[b], block_size, kvh * d, d,
                  task % per_seq * heads_per_task, heads_per_task, sliding_window,
                  num_sink_tokens, runs);
        lines.push(runs);
      };
      push_task(bounds[p0]);
      for (int64_t task = bounds[p0]; task < bounds[p1]; ++task) {
        if (stream) lines.begin_task();
        push_task(task + 1);  // the stream may run into the next task, not further
        const int64_t b = task / per_seq, h0 = task % per_seq * heads_per_task;
        decode_seq<scalar_t>(qp + b * qs, op + b * heads * d, k_plane, v_plane,
                             tables + b * max_blocks, lens[b], block_size, kvh, h0,
                             h0 + heads_per_task, group, d, static_cast<float>(scale),
                             sliding_window, num_sink_tokens, buf, lines);
      }
    });
  });
}

// One row of silu_mul: o[i] = silu(gu[i]) * gu[inter + i], silu rounded like torch's.
template <typename scalar_t>
void silu_mul_row(const scalar_t* gu, scalar_t* o, int64_t inter) {
  const scalar_t* u = gu + inter;
#pragma omp simd
  for (int64_t i = 0; i < inter; ++i) {
    const float x = to_float(gu[i]);
    const float silu = to_float(from_float<scalar_t>(x / (1.0f + exp_approx(-x))));
    o[i] = from_float<scalar_t>(silu * to_float(u[i]));
  }
}

// hidden += residual (if given); out = rms_norm(hidden) * weight, row by row. out may be
// residual itself: a row's residual is read before its output is written.
void add_rms_norm(Tensor hidden, const std::optional<Tensor>& residual, Tensor weight,
                  double eps, Tensor out) {
  check_rows(hidden, "hidden");
  check_rows(out, "out");
  check_cpu(weight, "weight");
  const int64_t rows = hidden.size(0), n = hidden.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n, "weight must have ", n,
              " contiguous elements");
  TORCH_CHECK(out.sizes() == hidden.sizes(), "out must match hidden's shape");
  TORCH_CHECK(out.scalar_type() == hidden.scalar_type() &&
                  weight.scalar_type() == hidden.scalar_type(),
              "hidden, weight and out must share a dtype");
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == hidden.sizes() &&
                    residual->scalar_type() == hidden.scalar_type(),
                "residual must match hidden's shape and dtype");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, hidden.scalar_type(), "add_rms_norm",
                                  [&] {
    scalar_t* h = hidden.data_ptr<scalar_t>();
    const scalar_t* res = residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr;
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t hs = hidden.stride(0), rs = res ? residual->stride(0) : 0, os = out.stride(0);
    at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
#if defined(KVSERVE_WIDE_SILU)
      if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
        for (int64_t t = begin; t < end; ++t) {
          rms_row_wide<scalar_t>(h + t * hs, res ? res + t * rs : nullptr, w, o + t * os, n,
                                 static_cast<float>(eps));
        }
        return;
      }
#endif
      for (int64_t t = begin; t < end; ++t) {
        rms_row<scalar_t>(h + t * hs, res ? res + t * rs : nullptr, w, o + t * os, n,
                          static_cast<float>(eps));
      }
    });
  });
}

// out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]
void silu_mul(Tensor out, Tensor gate_up) {
  check_rows(out, "out");
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), inter = out.size(1);
  TORCH_CHECK(gate_up.size(1) == 2 * inter && out.size(0) == rows,
              "gate_up must be [T, 2 I] for out [T, I]");
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type(), "out and gate_up must share a dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "silu_mul", [&] {
    const scalar_t* gu = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t gs = gate_up.stride(0), os = out.stride(0);
    at::parallel_for(0, rows, grain_for(inter), [&](int64_t begin, int64_t end) {
#if defined(KVSERVE_WIDE_SILU) || defined(KVSERVE_AVX2_SILU)
      if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
        for (int64_t t = begin; t < end; ++t) {
          silu_mul_row_wide<scalar_t>(gu + t * gs, o + t * os, inter);
        }
        return;
      }
#endif
      for (int64_t t = begin; t < end; ++t) silu_mul_row<scalar_t>(gu + t * gs, o + t * os, inter);
    });
  });
}

// First index of the row's maximum, a NaN counting as maximal (torch.max(dim).indices).
// NOTE: two passes: a vectorized max (and NaN check) over the row, then a scan for its first
// occurrence. ATen's max-with-indices keeps an index per lane and ran at ~1.2 G elements/s
// on [32, 49152] logits (1.3 ms, one thread), 20x slower than its plain amax.
// ``finite``: set to whether every element of the row is finite.
template <typename scalar_t>
int64_t argmax_row(const scalar_t* x, int64_t n, bool& finite) {
  float m = -std::numeric_limits<float>::infinity();
  int nan = 0, special = 0;
#pragma omp simd reduction(max : m) reduction(| : nan, special)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    nan |= v != v;
    special |= !(std::fabs(v) <= std::numeric_limits<float>::max());  // NaN or +-inf
    m = std::max(m, v);
  }
  finite = special == 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    if (nan ? v != v : v == m) return i;
  }
  return 0;  // n == 0 is rejected by the caller
}

#if defined(KVSERVE_WIDE_SILU)
#define KVSERVE_WIDE_ARGMAX 1
// argmax_row in one pass over 16 lanes: lane j keeps the largest value among elements
// j, j + 16, ... and its first index (a later equal value does not replace it); the row's
// answer is the smallest index among the lanes holding the largest value. A NaN ends the
// scan: the first one is the answer. ``finite``: as argmax_row's.
// NOTE: why. The two-pass version's second pass (the first occurrence of the maximum) ran
// scalar: greedy decoding's [32, 49152] bf16 logits took 0.47 ms on two threads, warm.
template <typename scalar_t>
int64_t argmax_row_wide(const scalar_t* x, int64_t n, bool& finite) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 best = _mm512_set1_ps(-kInf);  // masked tail lanes read as -inf too
  __m512i at = lane;  // index of `best` per lane
  __mmask16 special = 0;  // lanes that held +-inf (a NaN returns at once)
  finite = false;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask16(n - i);
    const __m512 v = _mm512_mask_blend_ps(m, _mm512_set1_ps(-kInf), load16(x + i, m));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (nan != 0) return i + __builtin_ctz(nan);
    special |= _mm512_mask_fpclass_ps_mask(m, v, 0x18);  // +inf (0x08) or -inf (0x10)
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    at = _mm512_mask_mov_epi32(at, gt, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(i))));
  }
  finite = special == 0;
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 hold = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(hold, at);
}
#endif

// out [N] int64 = per-row argmax of logits [N, V] (rows contiguous); finite [N] bool (if
// given) = whether each row is free of NaN and infinities, found in the same pass.
// NOTE: why in the same pass: the sampling guard's own check (a sum over the logits) read the
// [32, 49152] bf16 rows again, cold from the lm_head's writes: ~0.3 ms of a ~20 ms step.
void argmax_rows(Tensor out, Tensor logits, const std::optional<Tensor>& finite) {
  check_rows(logits, "logits");
  check_cpu(out, "out");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n > 0, "logits must have at least one column");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == rows,
              "out must be a contiguous int64 tensor of ", rows, " elements");
  if (finite.has_value()) {
    check_cpu(*finite, "finite");
    TORCH_CHECK(finite->scalar_type() == at::kBool && finite->is_contiguous() &&
                    finite->numel() == rows,
                "finite must be a contiguous bool tensor of ", rows, " elements");
  }
  int64_t* o = out.data_ptr<int64_t>();
  bool* fin = finite.has_value() ? finite->data_ptr<bool>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "argmax_rows",
                                  [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    const int64_t xs = logits.stride(0);
    at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
#if defined(KVSERVE_WIDE_ARGMAX)
      if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
        for (int64_t r = begin; r < end; ++r) {
          bool ok = false;
          o[r] = argmax_row_wide<scalar_t>(x + r * xs, n, ok);
          if (fin != nullptr) fin[r] = ok;
        }
        return;
      }
#endif
      for (int64_t r = begin; r < end; ++r) {
        bool ok = false;
        o[r] = argmax_row<scalar_t>(x + r * xs, n, ok);
        if (fin != nullptr) fin[r] = ok;
      }
    });
  });
}

// The projection kernels of kvserve_quant_ops.cpp (a library of its own), called through the
// dispatcher: they are not linked into this one. The signatures are those ops' kernels'.
using QuantLinearFn = void(Tensor, const Tensor&, const Tensor&, int64_t,
                           const std::optional<Tensor>&, int64_t, int64_t);
using AmxBf16LinearFn = void(Tensor, const Tensor&, const Tensor&, int64_t);
// kvserve::amx_linear and kvserve::amx_int8_linear: this library's, defined in other files
// (kvserve_amx_linear.cpp, kvserve_amx_int8.cpp) and reached the same way.
using PackedLinearFn = void(Tensor, const Tensor&, const Tensor&);

// A projection part: which kernel, its codes, and the output columns it writes.
constexpr int64_t kPartInts = 6;  // kind, qtype, isa, layout, first column, end column
constexpr int64_t kPartInt8Dot = 0;   // kvserve_quant::linear (qtype, isa, layout)
constexpr int64_t kPartAmxBf16 = 1;   // kvserve_quant::amx_bf16_linear (qtype; x16 layout)
constexpr int64_t kPartMm = 2;        // at::mm_out on the weight's [K, N] view
constexpr int64_t kPartOneDnn = 3;    // mkldnn::_linear_pointwise on a prepacked weight
constexpr int64_t kPartAmxInt8 = 4;   // kvserve::amx_int8_linear on an int8 copy
constexpr int64_t kPartAmxDense = 5;  // kvserve::amx_linear on a dense bf16 weight in tiles

// out [T, N] = x [T, K] times the weight of parts [first, first + count): each part writes
// its columns, as QuantKernelMethod, QuantAmxBf16Method, QuantSplitMethod, QuantAmxInt8Method,
// AmxBf16Method (and DequantAmxMethod, its copy of a quantized weight), DenseMmMethod and
// OneDnnPrepackedMethod do (the last allocates its result; it is copied into out).
// NOTE: each kernel's handle is looked up on its first use, so a dense model runs without the
// quantized-weight library loaded.
void project(const Tensor& out, const Tensor& x, at::TensorList weights, at::IntArrayRef parts,
             int64_t first, int64_t count) {
  for (int64_t p = first; p < first + count; ++p) {
    const int64_t* info = parts.data() + p * kPartInts;
    const bool whole = info[4] == 0 && info[5] == out.size(1);
    Tensor dst = whole ? out : out.narrow(1, info[4], info[5] - info[4]);
    if (info[0] == kPartAmxBf16) {
      static const auto amx = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("kvserve_quant::amx_bf16_linear", "")
                                  .typed<AmxBf16LinearFn>();
      amx.call(dst, x, weights[p], info[1]);
    } else if (info[0] == kPartAmxInt8) {
      static const auto int8 = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("kvserve::amx_int8_linear", "")
                                   .typed<PackedLinearFn>();
      int8.call(dst, x, weights[p]);
    } else if (info[0] == kPartAmxDense) {
      static const auto dense = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("kvserve::amx_linear", "")
                                    .typed<PackedLinearFn>();
      dense.call(dst, x, weights[p]);
    } else if (info[0] == kPartMm) {
      at::mm_out(dst, x, weights[p]);
    } else if (info[0] == kPartOneDnn) {
      // NOTE: boxed: the op's C++ signature (Scalar?[], str?) is awkward to spell typed, and
      // a boxed call costs ~1 us against the matmul's tens.
      static const auto onednn = c10::Dispatcher::singleton().findSchemaOrThrow(
          "mkldnn::_linear_pointwise", "");
      std::vector<c10::IValue> stack{x, weights[p], c10::IValue(), std::string("none"),
                                     c10::List<std::optional<at::Scalar>>(), std::string("")};
      onednn.callBoxed(&stack);
      dst.copy_(stack[0].toTensor());
    } else {
      TORCH_CHECK(info[0] == kPartInt8Dot, "decode_layers: unknown part kind ", info[0]);
      static const auto linear = c10::Dispatcher::singleton()
                                     .findSchemaOrThrow("kvserve_quant::linear", "")
                                     .typed<QuantLinearFn>();
      linear.call(dst, x, weights[p], info[1], std::nullopt, info[2], info[3]);
    }
  }
}

// Every decoder layer of a step in one call, for the common case: every projection of every
// layer on one of the kernels above (its parts) and every query row a decode query of
// paged_decode_attention (decodes, and chunk rows through `query_tables`). The same kernels,
// arguments and order as LlamaDecoderLayer.forward on NativeLayerOps and NativeCPUBackend,
// so the same results bit for bit; only the Python between them is gone.
// NOTE: why. A B=1 step of the embedded model dispatched 343 ops from Python, each ~2 us of
// dispatch plus the wrappers around it: its kernels alone took 3.6 ms of a 5.3 ms step
// (docs/KERNELS_HISTORY.md, session 17).
// hidden [T, h] residual stream, updated in place; residual: the MLP output to add first, or
// none; cos, sin [T, 1, d]. Per layer l: input_norms[l], post_norms[l] [h]; the qkv, o,
// gate_up and down projections, projection j made of part_counts[j] consecutive weights and
// kPartInts codes each in `parts`; kv_caches[l]. block_tables [T, max_blocks] int32 and
// seq_lens [T] int32 of the query rows. The step's buffers: norm [T, h] (on return: the last
// layer's MLP output, not yet added), qkv [T, (H + 2 kvh) d], attn [T, H d], gate_up [T, 2 I],
// act [T, I].
void decode_layers(Tensor hidden, const std::optional<Tensor>& residual, Tensor cos,
                         Tensor sin, at::TensorList input_norms, at::TensorList post_norms,
                         at::TensorList weights, at::IntArrayRef parts,
                         at::IntArrayRef part_counts, at::TensorList kv_caches,
                         Tensor slot_mapping, Tensor block_tables, Tensor seq_lens,
                         int64_t num_heads, double eps, double scale, int64_t sliding_window,
                         int64_t num_sink_tokens, Tensor norm, Tensor qkv, Tensor attn,
                         Tensor gate_up, Tensor act) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  const int64_t num_weights = static_cast<int64_t>(weights.size());
  TORCH_CHECK(layers >= 1 && static_cast<int64_t>(input_norms.size()) == layers &&
                  static_cast<int64_t>(post_norms.size()) == layers &&
                  static_cast<int64_t>(part_counts.size()) == 4 * layers,
              "decode_layers: one cache, two norms and four projections per layer");
  int64_t total_parts = 0;
  for (const int64_t n : part_counts) {
    TORCH_CHECK(n >= 1, "decode_layers: a projection needs at least one part");
    total_parts += n;
  }
  TORCH_CHECK(total_parts == num_weights &&
                  static_cast<int64_t>(parts.size()) == kPartInts * num_weights,
              "decode_layers: ", kPartInts, " codes per weight and as many weights as ",
              "the projections' parts");
  check_cache(kv_caches[0]);
  check_rows(qkv, "qkv");
  check_rows(attn, "attn");
  const int64_t rows = hidden.size(0), kvh = kv_caches[0].size(3), d = kv_caches[0].size(4);
  const int64_t qk_width = (num_heads + kvh) * d;
  TORCH_CHECK(qkv.size(0) == rows && qkv.size(1) == qk_width + kvh * d,
              "qkv must be [T, (H + 2 kvh) d]");
  TORCH_CHECK(attn.size(0) == rows && attn.size(1) == num_heads * d && attn.is_contiguous(),
              "attn must be a contiguous [T, H d] tensor");
  // The views every layer uses (StepViews in llama.py).
  const Tensor qk = qkv.narrow(1, 0, qk_width).view({rows, num_heads + kvh, d});
  const Tensor q = qk.narrow(1, 0, num_heads);
  const Tensor k = qk.narrow(1, num_heads, kvh);
  const Tensor v = qkv.narrow(1, qk_width, kvh * d).view({rows, kvh, d});
  const Tensor attn_heads = attn.view({rows, num_heads, d});
  int64_t part = 0, proj = 0;
  auto next = [&](const Tensor& out, const Tensor& x) {
    project(out, x, weights, parts, part, part_counts[proj]);
    part += part_counts[proj++];
  };
  for (int64_t l = 0; l < layers; ++l) {
    add_rms_norm(hidden, l == 0 ? residual : std::optional<Tensor>(norm), input_norms[l], eps,
                 norm);
    next(qkv, norm);
    rope_(qk, cos, sin);
    write_kv(kv_caches[l], k, v, slot_mapping);
    paged_decode_attention(attn_heads, q, kv_caches[l], block_tables, seq_lens, scale,
                           sliding_window, num_sink_tokens);
    next(norm, attn);
    add_rms_norm(hidden, norm, post_norms[l], eps, norm);
    next(gate_up, norm);
    silu_mul(act, gate_up);
    next(norm, act);
  }
}

}  // namespace

TORCH_LIBRARY(kvserve, m) {
  m.def("add_rms_norm(Tensor(a!) hidden, Tensor? residual, Tensor weight, float eps, "
        "Tensor(b!) out) -> ()");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("write_kv(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, int sliding_window, "
        "int num_sink_tokens) -> ()");
  m.def("silu_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("argmax_rows(Tensor(a!) out, Tensor logits, Tensor(b!)? finite=None) -> ()");
  m.def("decode_layers(Tensor(a!) hidden, Tensor? residual, Tensor cos, Tensor sin, "
        "Tensor[] input_norms, Tensor[] post_norms, Tensor[] weights, int[] parts, "
        "int[] part_counts, Tensor(b!)[] kv_caches, Tensor slot_mapping, Tensor block_tables, "
        "Tensor seq_lens, int num_heads, float eps, float scale, int sliding_window, "
        "int num_sink_tokens, Tensor(c!) norm, Tensor(d!) qkv, Tensor(e!) attn, "
        "Tensor(f!) gate_up, Tensor(g!) act) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("write_kv", &write_kv);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("decode_layers", &decode_layers);
}

// NOTE: oneDNN's prepacked weights are MkldnnCPU tensors: among decode_layers' weights
// they make the dispatcher look for that backend's kernel.
TORCH_LIBRARY_IMPL(kvserve, MkldnnCPU, m) {
  m.impl("decode_layers", &decode_layers);
}

}  // namespace kvserve
