// decode_layers: every decoder layer of a step in one call, the projections through the
// kernels the model chose for each (project) and the other ops (ops.h) between them.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/mm.h>

#include <optional>
#include <string>
#include <vector>

#include "common.h"
#include "ops.h"

namespace kvserve {

namespace {

// The projection kernels of kvserve_quant (csrc/quant/, a library of its own), called
// through the dispatcher: they are not linked into this one. The signatures are those ops'
// kernels'.
using QuantLinearFn = void(Tensor, const Tensor&, const Tensor&, int64_t,
                           const std::optional<Tensor>&, int64_t, int64_t);
using AmxBf16LinearFn = void(Tensor, const Tensor&, const Tensor&, int64_t);
// kvserve::amx_linear and kvserve::amx_int8_linear: this library's, defined in other files
// (amx_linear.cpp, amx_int8.cpp) and reached the same way.
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
      // NOTE: one row padded to two, as OneDnnPrepackedMethod.apply does: oneDNN's one-row
      // (gemv) kernel sums in another order than its GEMM at some shapes.
      const bool one = x.size(0) == 1;
      std::vector<c10::IValue> stack{one ? x.expand({2, x.size(1)}).contiguous() : x,
                                     weights[p], c10::IValue(), std::string("none"),
                                     c10::List<std::optional<at::Scalar>>(), std::string("")};
      onednn.callBoxed(&stack);
      dst.copy_(one ? stack[0].toTensor().narrow(0, 0, 1) : stack[0].toTensor());
    } else {
      TORCH_CHECK(info[0] == kPartInt8Dot, "decode_layers: unknown part kind ", info[0]);
      static const auto linear = c10::Dispatcher::singleton()
                                     .findSchemaOrThrow("kvserve_quant::linear", "")
                                     .typed<QuantLinearFn>();
      linear.call(dst, x, weights[p], info[1], std::nullopt, info[2], info[3]);
    }
  }
}

}  // namespace

// Every decoder layer of a step in one call, for the common case: every projection of every
// layer on one of the kernels of project (its parts) and every query row a decode query of
// paged_decode_attention (decodes, and chunk rows through `query_tables`). The same kernels,
// arguments and order as LlamaDecoderLayer.forward on NativeLayerOps and NativeCPUBackend,
// so the same results bit for bit; only the Python between them is gone.
// NOTE: why. A B=1 step of the embedded model dispatched 343 ops from Python, each ~2 us of
// dispatch plus the wrappers around it: its kernels alone took 3.6 ms of a 5.3 ms step
// (the Xeon without AMX, 2026-12-03, 33ddfab; docs/kernels-rationale.md, section 7).
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
  // The views every layer uses (StepViews in models/decoder_layer.py).
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

}  // namespace kvserve
