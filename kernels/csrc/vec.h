// Shared by the fused CPU kernels (kernels/csrc/*.cpp): fp32 vectors of the build's ISA and
// the loads, stores and roundings that keep 16-bit results on the twins' rounding points.
//
// Invariants shared by every kernel:
// - Math in fp32; inputs of 16-bit dtypes are widened on load and rounded (to nearest even)
//   only where the twin rounds, so a bf16 result matches the twin's rounding points.
// - The innermost dimension of every tensor argument is contiguous (checked); outer strides
//   are passed through, so strided views (q inside the fused qkv output) need no copy.
// - Work is split with at::parallel_for over torch's intra-op threads, with grains sized so
//   small batches stay on one thread rather than paying a fork/join.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace folio_cpu {

using at::vec::Vectorized;
using fVec = Vectorized<float>;
constexpr int64_t kV = fVec::size();

// Elements one parallel chunk should hold before a second thread is worth waking.
constexpr int64_t kGrainElems = 1 << 14;

template <typename T>
inline fVec load_f(const T* p) {  // kV elements, widened to fp32
  if constexpr (std::is_same_v<T, float>) {
    return fVec::loadu(p);
  } else {
    fVec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

template <>
inline fVec load_f<int8_t>(const int8_t* p) {  // kV int8 values, exactly, as fp32
#if defined(CPU_CAPABILITY_AVX512)
  return fVec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return fVec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  alignas(64) float wide[kV];
  for (int64_t i = 0; i < kV; ++i) wide[i] = p[i];
  return fVec::loadu(wide);
#endif
}

// kV float8 e4m3fn values, exactly, as fp32: each byte's sign, exponent and mantissa moved into
// an fp16 (exponent bias 15 against e4m3's 7, so the value is 2^-8 of the byte's) that F16C
// widens, subnormals included, then scaled by 2^8 (exact); 0x7f/0xff (e4m3fn's NaN) made NaN.
template <>
inline fVec load_f<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i em = _mm256_and_si256(u, _mm256_set1_epi16(0x7f));
  __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x80)), 8),
                              _mm256_slli_epi16(em, 7));
  h = _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi16(em, _mm256_set1_epi16(0x7f)),
                                          _mm256_set1_epi16(0x7c00)));
  return fVec(_mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i u = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i em = _mm_and_si128(u, _mm_set1_epi16(0x7f));
  __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(u, _mm_set1_epi16(0x80)), 8),
                           _mm_slli_epi16(em, 7));
  h = _mm_or_si128(h, _mm_and_si128(_mm_cmpeq_epi16(em, _mm_set1_epi16(0x7f)),
                                    _mm_set1_epi16(0x7c00)));
  return fVec(_mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f)));
#else
  alignas(64) float wide[kV];
  for (int64_t i = 0; i < kV; ++i) wide[i] = static_cast<float>(p[i]);
  return fVec::loadu(wide);
#endif
}

template <typename T>
inline void store_f(T* p, const fVec& v) {  // kV elements, rounded to T
  if constexpr (std::is_same_v<T, float>) {
    v.store(p);
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, kV);
  }
}

template <typename T>
inline fVec round_f(const fVec& v) {  // v rounded to T and widened back
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v)));
  }
}

template <typename T>
inline float round_s(float x) {
  return static_cast<float>(static_cast<T>(x));
}

inline float hsum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, v);
}

inline int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(row_elems, 1));
}

// float, bfloat16 and float16: the dtypes the executor runs.
#define FOLIO_DISPATCH(TYPE, NAME, ...)                                           \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)         \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)                  \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

inline void check_inner_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, " must have a contiguous last dimension");
}

// What both attention kernels require of q, out and the paged caches: q and out [rows, heads,
// head_dim] alike, caches [num_blocks, block_size, num_kv_heads, head_dim], one dtype, GQA
// groups whole, innermost dimensions contiguous.
// A quantized cache's scales (kernels/kv_quant.py): value = code * scale[blk, off, kv_head],
// fp32 [num_blocks, block_size, num_kv_heads] with any strides (static per-head scales are a
// stride-0 view); data null for a cache in q's dtype.
struct KVScales {
  const float* data = nullptr;
  int64_t sb = 0, st = 0, sh = 0;
  float at(int64_t blk, int64_t off, int64_t h) const { return data[blk * sb + off * st + h * sh]; }
};

inline KVScales kv_scales(const std::optional<at::Tensor>& scale) {
  if (!scale.has_value()) return {};
  return {scale->data_ptr<float>(), scale->stride(0), scale->stride(1), scale->stride(2)};
}

// The cache's element type as kv_t: q's (scalar_t), int8 or float8 e4m3fn.
#define FOLIO_DISPATCH_KV(CACHE_TYPE, Q_TYPE, ...)                        \
  [&] {                                                                  \
    if ((CACHE_TYPE) == at::kChar) {                                     \
      using kv_t = int8_t;                                               \
      return __VA_ARGS__();                                              \
    } else if ((CACHE_TYPE) == at::kFloat8_e4m3fn) {                     \
      using kv_t = c10::Float8_e4m3fn;                                   \
      return __VA_ARGS__();                                              \
    } else {                                                             \
      using kv_t = Q_TYPE;                                               \
      return __VA_ARGS__();                                              \
    }                                                                    \
  }()

inline void check_attention_operands(const at::Tensor& out, const at::Tensor& q,
                                     const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const std::optional<at::Tensor>& k_scale,
                                     const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q, out must be [rows, heads, dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "caches must be [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "head_dim must match the cache");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "q and out share a dtype, and so do the caches");
  const bool quantized = k_cache.scalar_type() == at::kChar ||
                         k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(quantized || q.scalar_type() == k_cache.scalar_type(),
              "the caches must hold q's dtype, int8 or float8_e4m3fn");
  TORCH_CHECK(quantized == k_scale.has_value() && quantized == v_scale.has_value(),
              "k_scale and v_scale come with an int8 or fp8 cache, and only with one");
  if (quantized) {
    for (const auto* sc : {&*k_scale, &*v_scale}) {
      TORCH_CHECK(sc->device().is_cpu() && sc->scalar_type() == at::kFloat && sc->dim() == 3 &&
                      sc->size(0) == k_cache.size(0) && sc->size(1) == k_cache.size(1) &&
                      sc->size(2) == k_cache.size(2),
                  "KV scales must be [num_blocks, block_size, num_kv_heads] fp32");
    }
  }
  check_inner_contiguous(q, "q");
  check_inner_contiguous(k_cache, "k_cache");
  check_inner_contiguous(v_cache, "v_cache");
  check_inner_contiguous(out, "out");
}

// The attention variants both attention kernels take (twins.paged_attention defines them).
// Logit soft-capping: s[0..n) <- cap * tanh(s / cap), n a multiple of kV; the twin's operations
// (a division, not a product with 1 / cap).
inline void softcap_scores(float* s, int64_t n, float cap) {
  const fVec c(cap);
  for (int64_t i = 0; i < n; i += kV) (c * (fVec::loadu(s + i) / c).tanh()).store(s + i);
}

// What a row's unnormalised output (online softmax: running max m, sum l relative to it) is
// multiplied by: 1 / l, or with a sink logit (sink non-null) exp(m - t) / (l exp(m - t) +
// exp(*sink - t)), t = max(m, *sink): the sink joins the denominator, its weight dropped.
inline float softmax_norm(float m, float l, const float* sink) {
  if (sink == nullptr) return 1.f / l;
  const float top = std::max(m, *sink);
  const float a = std::exp(m - top);
  return a / (l * a + std::exp(*sink - top));
}

// sinks must be [num_heads] fp32 when given: its data, or nullptr.
inline const float* sinks_data(const std::optional<at::Tensor>& sinks, int64_t num_heads) {
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat &&
                  sinks->dim() == 1 && sinks->size(0) == num_heads && sinks->is_contiguous(),
              "sinks must be [num_heads] fp32, contiguous");
  return sinks->data_ptr<float>();
}

// The ops, as torch.ops.folio_cpu registers them (ops.cpp).
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                 const std::optional<at::Tensor>& residual);
at::Tensor silu_and_mul(const at::Tensor& x);
void rotary(const at::Tensor& positions, at::Tensor q, at::Tensor k, const at::Tensor& cos_sin);
void decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, double scale, int64_t window, double softcap,
                      const std::optional<at::Tensor>& sinks,
                      const std::optional<at::Tensor>& k_scale,
                      const std::optional<at::Tensor>& v_scale);
void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& block_tables,
                       const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                       const at::Tensor& seq_ids, double scale, int64_t window, double softcap,
                       const std::optional<at::Tensor>& sinks,
                       const std::optional<at::Tensor>& k_scale,
                       const std::optional<at::Tensor>& v_scale);
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias, int64_t out_features);
at::Tensor skinny_linear_q8(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& scale, const std::optional<at::Tensor>& bias,
                            int64_t out_features);
at::Tensor skinny_linear_g4(const at::Tensor& x, const at::Tensor& slabs, const at::Tensor& scales,
                            const std::optional<at::Tensor>& offsets,
                            const std::optional<at::Tensor>& bias, int64_t out_features,
                            int64_t group_size);
at::Tensor skinny_linear_g8(const at::Tensor& x, const at::Tensor& slabs, const at::Tensor& scales,
                            const std::optional<at::Tensor>& offsets,
                            const std::optional<at::Tensor>& bias, int64_t out_features,
                            int64_t group_size);
at::Tensor skinny_linear_f8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                            const std::optional<at::Tensor>& bias, int64_t out_features);

}  // namespace folio_cpu
