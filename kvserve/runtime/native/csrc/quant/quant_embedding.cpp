// kvserve_quant::embedding: rows of a quantized table, dequantized (dequant_row).
#include "quant_common.h"

namespace kvserve_quant {

// out [T, K] = dequant(weight)[ids]: the embedding lookup of a quantized table.
void quant_embedding(Tensor out, const Tensor& ids, const Tensor& weight, int64_t qtype,
                     int64_t layout) {
  TORCH_CHECK(layout == 0 || layout == kGroup, "kvserve_quant: unknown layout code ", layout);
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.stride(1) == 1,
              "kvserve_quant: out must be a 2-D CPU tensor with contiguous rows");
  check_weight(weight, qtype, out.size(1));
  TORCH_CHECK(layout == 0 || !is_kquant(static_cast<int>(qtype)),
              "kvserve_quant: the K-quants have no x16 layout");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.size(0) == out.size(0),
              "kvserve_quant: ids must be int64 [T] with T = out.size(0)");
  const Tensor idc = ids.contiguous();
  const int64_t* ip = idc.data_ptr<int64_t>();
  const int64_t t_n = out.size(0), k = out.size(1), rows = weight.size(0);
  for (int64_t t = 0; t < t_n; ++t)
    TORCH_CHECK(ip[t] >= 0 && ip[t] < rows, "kvserve_quant: token id ", ip[t], " out of range");
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const int64_t row_bytes = weight.size(1), stride = out.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "quant_embedding",
                                  [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, t_n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        dequant_row<scalar_t>(wp, row_bytes, rows, static_cast<int>(layout), ip[t],
                              static_cast<int>(qtype), k, op + t * stride);
    });
  });
}

}  // namespace kvserve_quant
