// The ops of the `kvserve` library, as bindings.cpp registers them (schemas there) and
// decode_layers.cpp calls them. One file each: README.md has the map.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace kvserve {

using at::Tensor;

// rms_norm.cpp
void add_rms_norm(Tensor hidden, const std::optional<Tensor>& residual, Tensor weight,
                  double eps, Tensor out);
// rope.cpp
void rope_(Tensor x, Tensor cos, Tensor sin);
// write_kv.cpp
void write_kv(Tensor kv_cache, Tensor k, Tensor v, Tensor slot_mapping);
// decode_attention.cpp
void paged_decode_attention(Tensor out, Tensor q, Tensor kv_cache, Tensor block_tables,
                            Tensor seq_lens, double scale, int64_t sliding_window,
                            int64_t num_sink_tokens);
// silu_mul.cpp
void silu_mul(Tensor out, Tensor gate_up);
// argmax.cpp
void argmax_rows(Tensor out, Tensor logits, const std::optional<Tensor>& finite);
// decode_layers.cpp
void decode_layers(Tensor hidden, const std::optional<Tensor>& residual, Tensor cos,
                   Tensor sin, at::TensorList input_norms, at::TensorList post_norms,
                   at::TensorList weights, at::IntArrayRef parts, at::IntArrayRef part_counts,
                   at::TensorList kv_caches, Tensor slot_mapping, Tensor block_tables,
                   Tensor seq_lens, int64_t num_heads, double eps, double scale,
                   int64_t sliding_window, int64_t num_sink_tokens, Tensor norm, Tensor qkv,
                   Tensor attn, Tensor gate_up, Tensor act);
// amx_linear.cpp
bool amx_supported();
void amx_linear(Tensor out, const Tensor& x, const Tensor& packed);
// amx_attention.cpp
bool amx_prefill_supported(int64_t head_dim);
void amx_prefill_attention(Tensor out, Tensor q, Tensor kv_cache, Tensor block_table,
                           int64_t ctx_len, double scale);
// amx_int8.cpp
bool amx_int8_supported();
void amx_int8_linear(Tensor out, const Tensor& x, const Tensor& packed);

}  // namespace kvserve
