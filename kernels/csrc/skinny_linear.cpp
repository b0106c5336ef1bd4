// Linear layers on a few rows (decode batches): y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]),
// the weight in 16-feature slabs (skinny.h: layout, tiling, determinism). 16-bit weights are
// widened on load; int8 weights (skinny_linear_q8, weight-only int8 with one fp32 scale per
// output feature) too, the scale applied to each feature's fp32 sum before the bias.

#include "skinny.h"

namespace folio_cpu {

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias, int64_t out_features) {
  check_skinny_args(x, packed, bias, out_features, x.size(1));
  TORCH_CHECK(packed.scalar_type() == x.scalar_type(), "skinny_linear: x and weight dtypes differ");
  at::Tensor out;
  FOLIO_DISPATCH(x.scalar_type(), "skinny_linear", [&] {
    out = skinny_op(x, packed.size(0), bias, out_features, nullptr,
                    [&](const float* xp) {
      return SlabKernel<scalar_t>{xp, packed.data_ptr<scalar_t>(), x.size(1)};
    });
  });
  return out;
}

at::Tensor skinny_linear_q8(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& scale, const std::optional<at::Tensor>& bias,
                            int64_t out_features) {
  check_skinny_args(x, packed, bias, out_features, x.size(1));
  TORCH_CHECK(packed.scalar_type() == at::kChar, "skinny_linear_q8: the weight must be int8");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == out_features && scale.is_contiguous() &&
                  scale.scalar_type() == at::kFloat && scale.device().is_cpu(),
              "skinny_linear_q8: scale must be [out_features] fp32, contiguous, on the CPU");
  return skinny_op(x, packed.size(0), bias, out_features, scale.data_ptr<float>(),
                   [&](const float* xp) {
    return SlabKernel<int8_t>{xp, packed.data_ptr<int8_t>(), x.size(1)};
  });
}

}  // namespace folio_cpu
