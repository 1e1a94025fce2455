// The `kvserve_quant` op library's registration (torch.ops.kvserve_quant.*). The only file of
// the library that includes torch/library.h.
#include <torch/library.h>

#include "quant_common.h"

namespace kvserve_quant {

namespace {

bool quant_isa_supported(int64_t isa) { return isa_supported(static_cast<int>(isa)); }

bool quant_amx_bf16_supported() { return amx_bf16_ready(); }

int64_t quant_best_isa() { return best_isa(); }

}  // namespace

}  // namespace kvserve_quant

TORCH_LIBRARY(kvserve_quant, m) {
  m.def(
      "linear(Tensor(a!) out, Tensor x, Tensor weight, int qtype, Tensor? bias, int isa, "
      "int layout=0) -> ()");
  m.def("embedding(Tensor(a!) out, Tensor ids, Tensor weight, int qtype, int layout=0) -> ()");
  m.def("amx_bf16_linear(Tensor(a!) out, Tensor x, Tensor weight, int qtype) -> ()");
  m.def("amx_bf16_supported() -> bool", &kvserve_quant::quant_amx_bf16_supported);
  m.def("isa_supported(int isa) -> bool", &kvserve_quant::quant_isa_supported);
  m.def("best_isa() -> int", &kvserve_quant::quant_best_isa);
}

TORCH_LIBRARY_IMPL(kvserve_quant, CPU, m) {
  m.impl("linear", &kvserve_quant::quant_linear);
  m.impl("embedding", &kvserve_quant::quant_embedding);
  m.impl("amx_bf16_linear", &kvserve_quant::quant_amx_bf16_linear);
}
