// What every op of the `kvserve` library shares: the light ATen headers (no ATen/ATen.h and
// no torch/library.h outside bindings.cpp: each costs seconds of compile time per file), the
// parallel grain and the argument checks.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

#include "arch/vec.h"

namespace kvserve {

using at::Tensor;

// Rows of at least this many elements of work run in parallel; below it the OpenMP fork
// costs more than it saves (a decode step's rows at B=1 are 576-1536 elements).
constexpr int64_t kParallelWork = 1 << 15;

inline int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kParallelWork / std::max<int64_t>(1, work_per_item));
}

inline void check_cpu(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "kvserve native op: ", name, " must be a CPU tensor");
}

inline void check_rows(const Tensor& t, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, "kvserve native op: ", name,
              " must be 2-D with contiguous rows, got sizes ", t.sizes(), " strides ",
              t.strides());
}

// A paged KV cache: [2, num_blocks, block_size, kvh, d], contiguous.

inline void check_cache(const Tensor& cache) {
  check_cpu(cache, "kv_cache");
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, block_size, kvh, d] tensor");
}

}  // namespace kvserve
