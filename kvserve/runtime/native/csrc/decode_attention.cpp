// paged_decode_attention: B single-token queries attend over their sequences' K/V, read in
// place from the paged cache. A task (a sequence, or one KV head of one) runs decode_seq: the
// wide kernels of this build's instruction set (attention/decode_avx512.h or decode_avx2.h)
// where they take the shape, else the portable ones (attention/decode_portable.h).
#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention/decode_portable.h"
#include "attention/paged_kv.h"
#include "attention/softmax.h"
#include "common.h"
#include "ops.h"
#if defined(__AVX512F__)
#include "attention/decode_avx512.h"
#elif defined(KVSERVE_WIDE_ATTN)
#include "attention/decode_avx2.h"
#endif

namespace kvserve {

namespace {

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
  softmax_rows_wide<WideVec>(scores, nq, n_vis);
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
// the same positions spread evenly; the Xeon without AMX, 2026-12-03, 90a957a: git show
// 25ace60:bench/results/session18/attn_cold_ab.txt).
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

}  // namespace

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

}  // namespace kvserve
