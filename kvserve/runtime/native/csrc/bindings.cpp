// The `kvserve` op library's registration: every op's schema (Python calls them as
// torch.ops.kvserve.*) and its CPU kernel, from the files ops.h names. The only file of the
// library that includes torch/library.h.
#include <torch/library.h>

#include "ops.h"

namespace kvserve {

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

  m.def("amx_supported() -> bool", &amx_supported);
  m.def("amx_linear(Tensor(a!) out, Tensor x, Tensor packed) -> ()");
  m.def("amx_prefill_supported(int head_dim) -> bool", &amx_prefill_supported);
  m.def("amx_prefill_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_table, "
        "int ctx_len, float scale) -> ()");
  m.def("amx_int8_supported() -> bool", &amx_int8_supported);
  m.def("amx_int8_linear(Tensor(a!) out, Tensor x, Tensor packed) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("write_kv", &write_kv);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("decode_layers", &decode_layers);

  m.impl("amx_linear", &amx_linear);
  m.impl("amx_prefill_attention", &amx_prefill_attention);
  m.impl("amx_int8_linear", &amx_int8_linear);
}

// NOTE: oneDNN's prepacked weights are MkldnnCPU tensors: among decode_layers' weights
// they make the dispatcher look for that backend's kernel.
TORCH_LIBRARY_IMPL(kvserve, MkldnnCPU, m) {
  m.impl("decode_layers", &decode_layers);
}

}  // namespace kvserve
