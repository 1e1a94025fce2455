// Reading a sequence's visible K/V rows where they lie in the paged cache: the visible
// ranges (sliding window and sinks), the runs of rows one block holds, and LineStream, the
// software prefetch the wide decode kernels pump from inside their loops.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace kvserve {

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
// L1's miss buffers. The Zen 4 EPYC, 2026-12-02, a036922, bench/probes/attn_cold.py (at
// 25ace60) --threads 2 --huge-pages, alternating: 884-894 -> 729-746 us a layer on random
// blocks, 771-773 -> 649-667 on sequential ones; two blocks ahead instead of one was slower
// (755).
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
// NOTE: the AMX Xeon, 2026-12-05, 48aceb7, bench/probes/attn_cold.py (at 25ace60) --huge-pages
// --threads 2 --len 192: 256, 512 or 1024 lines ahead all took 260-303 us a layer at 4 a pump
// (325-329 before); 2 a pump fell behind the reader (438-487 us), 8 a pump 283-303.
constexpr int64_t kStreamAhead = 512;
constexpr int64_t kPumpLines = 4;

// The cache lines one thread's decode attention tasks read, in the order they read them (a
// task's K rows, then its V rows, then the next task's), prefetched into L2 a few at a time
// from inside the kernels' loops (`pump`), at most kStreamAhead lines past what they have
// read (`consumed`, reported a kv head's rows at a time). The caller pushes each task's runs
// one task ahead of the one it runs (`push`, `begin_task`), so the stream holds at most two
// tasks' runs; a stream that fell behind the reader skips to the task it begins.
// NOTE: why. Prefetching a block's ~200 K and V lines at once, as for_each_visible_run does,
// left a step's cold read and its arithmetic one after the other: a third q . k pass added its
// hot cost in full to the cold one (git show 25ace60:bench/results/session22/attn_overlap.txt).
// A burst of prefetches fills the L1's miss buffers (a prefetch to L2 takes one too), and the
// loads behind it wait. On a synthetic stream (bench/probes/prefetch_overlap.cpp at 25ace60)
// prefetches of 32 lines at a time overlapped none of the read with the arithmetic, 8 or 1 at a
// time most.
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

// The wide attention kernels of one shape (decode_seq_wide): `dot` scores up to kWideRows key
// rows for a kv head's query heads, `axpy` adds a run of value rows to their accumulators.
template <typename q_t, typename kv_t>
struct AttnKernels {
  void (*dot)(const q_t*, const kv_t* const*, int64_t, int64_t, int64_t, float, float*, int64_t,
              LineStream&);
  void (*axpy)(const float*, int64_t, const kv_t*, int64_t, int64_t, int64_t, float*,
               LineStream&);
};

}  // namespace kvserve
