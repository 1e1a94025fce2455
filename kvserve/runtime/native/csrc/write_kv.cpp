// write_kv: a step's new K and V rows into their slots of the paged cache.
#include <cstring>

#include "common.h"
#include "ops.h"

namespace kvserve {

namespace {

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

void check_kv_rows(const Tensor& x, const Tensor& cache, const char* name) {
  check_cpu(x, name);
  TORCH_CHECK(x.dim() == 3 && x.size(1) == cache.size(3) && x.size(2) == cache.size(4) &&
                  x.stride(2) == 1 && x.stride(1) == x.size(2),
              name, " must be [T, kvh, d] with contiguous rows matching the cache");
  TORCH_CHECK(x.scalar_type() == cache.scalar_type(), name, " must have the cache's dtype");
}

}  // namespace

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

}  // namespace kvserve
