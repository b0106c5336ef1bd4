// Fused CPU kernels for the executor's hot loop, registered as torch.ops.folio_cpu.*.
//
// Built on first use by kernels/cpu_ext.py (torch.utils.cpp_extension, no pybind) with the
// vector ISA of the machine it runs on (CPU_CAPABILITY = AVX512, AVX2 or DEFAULT), and checked
// against the torch twins in tests/kernels/test_cpu_ext.py. The kernels: elementwise.cpp,
// decode_attention.cpp, prefill_attention.cpp, skinny_linear.cpp, skinny_linear_quant.cpp, fused_moe.cpp; shared
// helpers and invariants: vec.h (all), skinny.h (the skinny linears).

#include <torch/library.h>

#include <string>

#include "vec.h"

namespace folio_cpu {

// What this build was compiled for (the CPU_CAPABILITY macros cpu_ext.py passes) and its fp32
// lanes: which shapes the kernels take depends on it (prefill_attention's head_dim), so callers
// and tests ask the build rather than assume a machine.
std::string isa() {
#if defined(CPU_CAPABILITY_AVX512)
  return "AVX512";
#elif defined(CPU_CAPABILITY_AVX2)
  return "AVX2";
#else
  return "DEFAULT";
#endif
}

int64_t vector_width() { return kV; }

// fused_moe.cpp
at::Tensor fused_moe_packed(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                            const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                            const std::optional<at::Tensor>& w13_bias,
                            const std::optional<at::Tensor>& w2_bias, int64_t activation,
                            double swiglu_limit, double swiglu_alpha, int64_t intermediate);

}  // namespace folio_cpu

TORCH_LIBRARY(folio_cpu, m) {
  m.def("isa() -> str", &folio_cpu::isa);  // no tensor arguments: one kernel for every key
  m.def("vector_width() -> int", &folio_cpu::vector_width);
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> Tensor[]");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos_sin) -> ()");
  m.def("decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, int window=0, float softcap=0.0, "
        "Tensor? sinks=None, Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, Tensor seq_ids, "
        "float scale, int window=0, float softcap=0.0, Tensor? sinks=None, "
        "Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.def("skinny_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("skinny_linear_q8(Tensor x, Tensor packed, Tensor scale, Tensor? bias, "
        "int out_features) -> Tensor");
  m.def("skinny_linear_g4(Tensor x, Tensor slabs, Tensor scales, Tensor? offsets, Tensor? bias, "
        "int out_features, int group_size) -> Tensor");
  m.def("skinny_linear_g8(Tensor x, Tensor slabs, Tensor scales, Tensor? offsets, Tensor? bias, "
        "int out_features, int group_size) -> Tensor");
  m.def("skinny_linear_f8(Tensor x, Tensor packed, Tensor scale, Tensor? bias, "
        "int out_features) -> Tensor");
  m.def("fused_moe_packed(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, "
        "Tensor topk_ids, Tensor? w13_bias, Tensor? w2_bias, int activation, "
        "float swiglu_limit, float swiglu_alpha, int intermediate) -> Tensor");
}

TORCH_LIBRARY_IMPL(folio_cpu, CPU, m) {
  m.impl("rms_norm", &folio_cpu::rms_norm);
  m.impl("silu_and_mul", &folio_cpu::silu_and_mul);
  m.impl("rotary", &folio_cpu::rotary);
  m.impl("decode_attention", &folio_cpu::decode_attention);
  m.impl("prefill_attention", &folio_cpu::prefill_attention);
  m.impl("skinny_linear", &folio_cpu::skinny_linear);
  m.impl("skinny_linear_q8", &folio_cpu::skinny_linear_q8);
  m.impl("skinny_linear_g4", &folio_cpu::skinny_linear_g4);
  m.impl("skinny_linear_g8", &folio_cpu::skinny_linear_g8);
  m.impl("skinny_linear_f8", &folio_cpu::skinny_linear_f8);
  m.impl("fused_moe_packed", &folio_cpu::fused_moe_packed);
}
