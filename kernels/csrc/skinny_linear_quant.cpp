// Skinny linears over quantized slabs (skinny.h: tiling, determinism), widened in registers:
//
// - skinny_linear_g4 / _g8: group-quantized weights, W[n, k] = q[n, k] * scale[n, g] +
//   offset[n, g] with g = k / group_size (executor_svc/quantization/grouped.py's definition).
//   Slabs, per block of 16 features (zero past N):
//     g8: q      [ceil(N / 16), K, 16]      int8, as pack_skinny_weight lays out any weight
//     g4: q      [ceil(N / 16), K / 2, 16]  uint8, k = 2j in the low nibble of row j, 2j + 1 high
//         scales [ceil(N / 16), G, 16]      fp32 or fp16 (S), G = K / group_size; offsets alike
//                                           (the same dtype), or none
//   fp16 scales and offsets (what GGUF's blocks store) widen exactly, so they read fewer bytes
//   and dequantize to the same fp32 weight. Each weight is dequantized in fp32 exactly as the
//   definition computes it (the product
//   rounded, then the offset added: the build does not contract to FMA), and the product runs
//   over those values as skinny_linear's fp32 path does: so the result is bitwise
//   skinny_linear(x, pack(dequantize())), whatever the rows. Up to one chunk of rows
//   (kRowChunk) dequantizes in registers as it streams; more rows dequantize each tile once
//   into a per-thread fp32 scratch slab (L2-sized) that every row chunk then reads.
// - skinny_linear_f8: float8 e4m3fn slabs [ceil(N / 16), K, 16], widened exactly on load
//   (vec.h; staged like the grouped ones past one row chunk), one fp32 scale per feature
//   applied to its sum before the bias (as _q8).

#include "skinny.h"

namespace folio_cpu {

namespace {

// Two fp32 vectors of 4-bit codes from kV bytes: the low nibbles (k even) and the high (k odd).
inline void load_nibbles(const uint8_t* p, fVec& lo, fVec& hi) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = fVec(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xf))));
  hi = fVec(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = fVec(_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xf))));
  hi = fVec(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)));
#else
  alignas(64) float l[kV], h[kV];
  for (int64_t i = 0; i < kV; ++i) l[i] = p[i] & 0xf, h[i] = p[i] >> 4;
  lo = fVec::loadu(l);
  hi = fVec::loadu(h);
#endif
}

// The codes of 4-bit (uint8, two k per byte) or 8-bit (int8) slabs, and their layout.
template <int Bits>
struct Codes {
  using Q = std::conditional_t<Bits == 4, uint8_t, int8_t>;
  static constexpr int kStep = Bits == 4 ? 2 : 1;  // k per slab row

  // w[0, kStep) = the codes of slab row `row` at vector offset p, as fp32.
  static inline void load(const Q* p, fVec* w) {
    if constexpr (Bits == 4) {
      load_nibbles(p, w[0], w[1]);
    } else {
      w[0] = load_f<int8_t>(p);
    }
  }
};

template <bool Off>
inline fVec dequant(const fVec& q, const fVec& s, const fVec& o) {
  if constexpr (Off) {
    return q * s + o;  // two roundings, as GroupedWeight.dequantize
  } else {
    return q * s;
  }
}

struct GroupedArgs {
  const void* q;        // slabs [num_blocks, K / kStep, 16]
  const void* scales;   // [num_blocks, G, 16] of S
  const void* offsets;  // [num_blocks, G, 16] of S, or null
  int64_t K, group_size;
};

// acc[r][v] of rows [0, R) over NV vectors of features from the block at q / scales / offsets
// (of S), dequantizing as it streams (the in-register path).
template <int Bits, bool Off, typename S, int NV>
struct GroupedProduct {
  template <int R>
  struct Rows {
    static void run(const float* x, int64_t x_stride, const GroupedArgs& a, int64_t block,
                    float* out) {
      using C = Codes<Bits>;
      const int64_t K = a.K, gs = a.group_size, G = K / gs;
      const int64_t qslab = K / C::kStep * kPackN, gslab = G * kPackN;
      const auto* q = static_cast<const typename C::Q*>(a.q) + block * qslab;
      const S* sc = static_cast<const S*>(a.scales) + block * gslab;
      const S* of = Off ? static_cast<const S*>(a.offsets) + block * gslab : nullptr;
      fVec acc[R][NV];
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v] = fVec(0.f);
      for (int64_t g = 0; g < G; ++g) {
        fVec s[NV], o[NV];
        for (int v = 0; v < NV; ++v) {
          const int64_t at = (v / kBlockVecs) * gslab + g * kPackN + (v % kBlockVecs) * kV;
          s[v] = load_f<S>(sc + at);
          o[v] = Off ? load_f<S>(of + at) : fVec(0.f);
        }
        for (int64_t k = g * gs; k < (g + 1) * gs; k += C::kStep) {
          fVec w[C::kStep][NV];
          for (int v = 0; v < NV; ++v) {
            const auto* p = q + (v / kBlockVecs) * qslab + k / C::kStep * kPackN +
                            (v % kBlockVecs) * kV;
            if (v % kBlockVecs == 0) __builtin_prefetch(p + kPrefetchRows * kPackN);
            fVec codes[C::kStep];
            C::load(p, codes);
            for (int i = 0; i < C::kStep; ++i) w[i][v] = dequant<Off>(codes[i], s[v], o[v]);
          }
          for (int i = 0; i < C::kStep; ++i) {
            for (int r = 0; r < R; ++r) {
              const fVec xb(x[r * x_stride + k + i]);
              for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(xb, w[i][v], acc[r][v]);
            }
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v].store(out + (r * NV + v) * kV);
    }
  };
};

// run_skinny's Kernel for grouped slabs. With more rows than one chunk, prepare() dequantizes
// the tile's blocks into `scratch` [blocks, K, 16] fp32 and product() runs the fp32 tile over it.
template <int Bits, bool Off, typename S>
struct GroupedKernel {
  const float* x;  // [M, K] fp32
  GroupedArgs a;
  bool staged;  // M > kRowChunk
  std::vector<float> scratch;
  int64_t staged_block0 = -1;

  void prepare(int64_t block0, int64_t blocks) {
    if (!staged) return;
    using C = Codes<Bits>;
    const int64_t K = a.K, gs = a.group_size, G = K / gs;
    const int64_t qslab = K / C::kStep * kPackN, gslab = G * kPackN;
    scratch.resize(blocks * K * kPackN);
    for (int64_t b = 0; b < blocks; ++b) {
      const auto* q = static_cast<const typename C::Q*>(a.q) + (block0 + b) * qslab;
      const S* sc = static_cast<const S*>(a.scales) + (block0 + b) * gslab;
      const S* of = Off ? static_cast<const S*>(a.offsets) + (block0 + b) * gslab : nullptr;
      float* dst = scratch.data() + b * K * kPackN;
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t j = 0; j < kPackN; j += kV) {
          const fVec s = load_f<S>(sc + g * kPackN + j);
          const fVec o = Off ? load_f<S>(of + g * kPackN + j) : fVec(0.f);
          for (int64_t k = g * gs; k < (g + 1) * gs; k += C::kStep) {
            fVec codes[C::kStep];
            C::load(q + k / C::kStep * kPackN + j, codes);
            for (int i = 0; i < C::kStep; ++i)
              dequant<Off>(codes[i], s, o).store(dst + (k + i) * kPackN + j);
          }
        }
      }
    }
    staged_block0 = block0;
  }

  template <int NV>
  void product(int rows, int64_t r0, int64_t block, float* acc) const {
    const int64_t K = a.K;
    if (staged) {
      tile_rows<float, NV>(rows, x + r0 * K, K, scratch.data() + (block - staged_block0) * K * kPackN,
                           K * kPackN, K, acc);
    } else {
      dispatch_rows<GroupedProduct<Bits, Off, S, NV>::template Rows>(rows, x + r0 * K, K, a,
                                                                     block, acc);
    }
  }
};

// run_skinny's Kernel for fp8 slabs: SlabKernel's, but with more rows than a chunk each tile is
// widened once into `scratch` (exact, so the result is the same bits) for every row chunk.
struct Fp8Kernel {
  const float* x;  // [M, K] fp32
  const c10::Float8_e4m3fn* w;  // [num_blocks, K, 16]
  int64_t K;
  bool staged;  // M > kRowChunk
  std::vector<float> scratch;
  int64_t staged_block0 = -1;

  void prepare(int64_t block0, int64_t blocks) {
    if (!staged) return;
    const int64_t n = blocks * K * kPackN;
    scratch.resize(n);
    const c10::Float8_e4m3fn* src = w + block0 * K * kPackN;
    for (int64_t i = 0; i < n; i += kV) load_f(src + i).store(scratch.data() + i);
    staged_block0 = block0;
  }

  template <int NV>
  void product(int rows, int64_t r0, int64_t block, float* acc) const {
    if (staged) {
      tile_rows<float, NV>(rows, x + r0 * K, K, scratch.data() + (block - staged_block0) * K * kPackN,
                           K * kPackN, K, acc);
    } else {
      tile_rows<c10::Float8_e4m3fn, NV>(rows, x + r0 * K, K, w + block * K * kPackN, K * kPackN,
                                        K, acc);
    }
  }
};

void check_group_args(const char* name, int bits, const at::Tensor& x, const at::Tensor& slabs,
                      const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                      const std::optional<at::Tensor>& bias, int64_t out_features,
                      int64_t group_size) {
  const int64_t K = x.dim() == 2 ? x.size(1) : 0;
  TORCH_CHECK(group_size > 0 && K % group_size == 0 && (bits == 8 || group_size % 2 == 0), name,
              ": in_features (", K, ") must be a multiple of group_size (", group_size,
              bits == 4 ? "), which must be even" : ")");
  check_skinny_args(x, slabs, bias, out_features, bits == 4 ? K / 2 : K);
  TORCH_CHECK(slabs.scalar_type() == (bits == 4 ? at::kByte : at::kChar), name,
              bits == 4 ? ": the slabs must be uint8 (two 4-bit codes a byte)"
                        : ": the slabs must be int8");
  const auto check_groups = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.dim() == 3 && t.size(0) == slabs.size(0) && t.size(1) == K / group_size &&
                    t.size(2) == kPackN && t.is_contiguous() &&
                    t.scalar_type() == scales.scalar_type() &&
                    (t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf) &&
                    t.device().is_cpu(),
                name, ": ", what, " must be fp32 or fp16 (scales and offsets alike) "
                "[ceil(N / 16), in_features / group_size, 16], contiguous, on the CPU");
  };
  check_groups(scales, "scales");
  if (offsets) check_groups(*offsets, "offsets");
}

template <int Bits>
at::Tensor grouped_op(const char* name, const at::Tensor& x, const at::Tensor& slabs,
                      const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                      const std::optional<at::Tensor>& bias, int64_t out_features,
                      int64_t group_size) {
  check_group_args(name, Bits, x, slabs, scales, offsets, bias, out_features, group_size);
  const GroupedArgs a{slabs.data_ptr(), scales.data_ptr(),
                      offsets ? offsets->data_ptr() : nullptr, x.size(1), group_size};
  const bool staged = x.size(0) > kRowChunk;
  const auto run = [&](auto off, auto scale_type) {
    using S = decltype(scale_type);
    return skinny_op(x, slabs.size(0), bias, out_features, nullptr, [&](const float* xp) {
      return GroupedKernel<Bits, decltype(off)::value, S>{xp, a, staged};
    });
  };
  if (scales.scalar_type() == at::kHalf) {
    return offsets ? run(std::true_type{}, c10::Half{}) : run(std::false_type{}, c10::Half{});
  }
  return offsets ? run(std::true_type{}, float{}) : run(std::false_type{}, float{});
}

}  // namespace

at::Tensor skinny_linear_g4(const at::Tensor& x, const at::Tensor& slabs, const at::Tensor& scales,
                            const std::optional<at::Tensor>& offsets,
                            const std::optional<at::Tensor>& bias, int64_t out_features,
                            int64_t group_size) {
  return grouped_op<4>("skinny_linear_g4", x, slabs, scales, offsets, bias, out_features,
                       group_size);
}

at::Tensor skinny_linear_g8(const at::Tensor& x, const at::Tensor& slabs, const at::Tensor& scales,
                            const std::optional<at::Tensor>& offsets,
                            const std::optional<at::Tensor>& bias, int64_t out_features,
                            int64_t group_size) {
  return grouped_op<8>("skinny_linear_g8", x, slabs, scales, offsets, bias, out_features,
                       group_size);
}

at::Tensor skinny_linear_f8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                            const std::optional<at::Tensor>& bias, int64_t out_features) {
  check_skinny_args(x, packed, bias, out_features, x.size(1));
  TORCH_CHECK(packed.scalar_type() == at::kFloat8_e4m3fn,
              "skinny_linear_f8: the weight must be float8_e4m3fn");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == out_features && scale.is_contiguous() &&
                  scale.scalar_type() == at::kFloat && scale.device().is_cpu(),
              "skinny_linear_f8: scale must be [out_features] fp32, contiguous, on the CPU");
  const bool staged = x.size(0) > kRowChunk;
  return skinny_op(x, packed.size(0), bias, out_features, scale.data_ptr<float>(),
                   [&](const float* xp) {
    return Fp8Kernel{xp, packed.data_ptr<c10::Float8_e4m3fn>(), x.size(1), staged};
  });
}

}  // namespace folio_cpu
