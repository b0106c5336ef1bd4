// The skinny linear kernels' shared machinery (skinny_linear.cpp, skinny_linear_quant.cpp).
//
// The weight is packed once as [ceil(N / 16), K, 16] (pack_skinny_weight,
// executor_svc/models/linear.py): for each block of 16 output features, one slab holding, for
// every k, the 16 features' weights side by side (zero past N). A work tile is a few consecutive
// blocks; it streams their slabs front to back (memory bound: each weight element is read once
// per call, by one thread) and keeps rows x features accumulators in registers, an outer
// product per k: broadcast x[m, k], multiply by the 16-wide weight vector, accumulate in fp32.
// Rows beyond a chunk re-read the tile's slabs from cache rather than memory. The sum over k
// runs in order, in fp32, rounded to the output dtype once; tiles are claimed from a shared
// counter, so the result depends neither on which thread computes which tile nor on the other
// rows of the batch.
#pragma once

#include <atomic>

#include "vec.h"

namespace folio_cpu {

constexpr int64_t kPackN = 16;                   // output features per packed block
constexpr int kTileVecs = 4;                     // accumulator vectors per row in a full tile
constexpr int kBlockVecs = kPackN / kV;          // vectors per packed block (1 on AVX512)
constexpr int kRowChunk = kV >= 16 ? 4 : 2;      // rows per pass: 16 accumulators at most
constexpr int64_t kTileBlocks = kTileVecs / kBlockVecs;
constexpr int64_t kPrefetchRows = 8;             // k rows ahead each slab is prefetched

// acc[r][v] over rows [0, R) and NV vectors of features; the v-th vector lives in block
// v / kBlockVecs of the tile, at offset (v % kBlockVecs) * kV inside its 16 features.
template <typename W, int R, int NV>
inline void tile_product(const float* x, int64_t x_stride, const W* w, int64_t slab, int64_t K,
                         float* out /* [R][NV * kV] */) {
  fVec acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = fVec(0.f);
  for (int64_t k = 0; k < K; ++k) {
    fVec wv[NV];
    for (int v = 0; v < NV; ++v) {
      const W* p = w + (v / kBlockVecs) * slab + k * kPackN + (v % kBlockVecs) * kV;
      if (v % kBlockVecs == 0) __builtin_prefetch(p + kPrefetchRows * kPackN);
      wv[v] = load_f(p);
    }
    for (int r = 0; r < R; ++r) {
      const fVec xb(x[r * x_stride + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(xb, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v].store(out + (r * NV + v) * kV);
}

// Calls F<R>::run(args...) with R = rows, a compile-time row count in [1, kRowChunk].
template <template <int> class F, typename... Args>
inline void dispatch_rows(int rows, Args&&... args) {
  switch (rows) {
    case 1: return F<1>::run(args...);
    case 2: return F<2>::run(args...);
    case 3: if constexpr (kRowChunk >= 3) return F<3>::run(args...); break;
    case 4: if constexpr (kRowChunk >= 4) return F<4>::run(args...); break;
  }
  TORCH_CHECK(false, "skinny_linear: bad row chunk ", rows);
}

template <typename W, int NV>
struct SlabProduct {
  template <int R>
  struct Rows {
    static void run(const float* x, int64_t x_stride, const W* w, int64_t slab, int64_t K,
                    float* out) {
      tile_product<W, R, NV>(x, x_stride, w, slab, K, out);
    }
  };
};

template <typename W, int NV>
inline void tile_rows(int rows, const float* x, int64_t x_stride, const W* w, int64_t slab,
                      int64_t K, float* out) {
  dispatch_rows<SlabProduct<W, NV>::template Rows>(rows, x, x_stride, w, slab, K, out);
}

// The driver every skinny op shares: tiles of kTileBlocks blocks claimed from a counter, rows
// in chunks of kRowChunk, each output element = (acc * scale[n] if scale) + bias[n], rounded to
// T. `Kernel` is copied once per thread and provides
//   void prepare(int64_t block0, int64_t blocks)           once per tile, before its rows;
//   template <int NV> void product(int rows, int64_t r0, int64_t block, float* acc)
//       acc[r][NV * kV] = the fp32 sums of rows r0 + r over NV vectors from `block` on.
template <typename T, typename Kernel>
void run_skinny(const Kernel& kernel, int64_t M, int64_t num_blocks, const T* bias,
                const float* scale, at::Tensor& out) {
  const int64_t N = out.size(1);
  const int64_t num_tiles = (num_blocks + kTileBlocks - 1) / kTileBlocks;
  T* op = out.data_ptr<T>();
  const int64_t so = out.stride(0);
  // Tiles are claimed from a shared counter: a thread the OS preempts (the scheduler process
  // shares these cores) holds up one tile, not a fixed share of them.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tiles), 1,
                   [&](int64_t, int64_t) {
    Kernel k = kernel;
    alignas(64) float acc[kRowChunk * kTileVecs * kV];
    for (int64_t t = next++; t < num_tiles; t = next++) {
      const int64_t block0 = t * kTileBlocks;
      const int64_t blocks = std::min<int64_t>(kTileBlocks, num_blocks - block0);
      k.prepare(block0, blocks);
      for (int64_t r0 = 0; r0 < M; r0 += kRowChunk) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowChunk, M - r0));
        // Each pass covers `width` features from n0 and leaves them in acc[r][0, width).
        auto emit = [&](int64_t n0, int64_t width, int64_t acc_row) {
          const int64_t valid = std::min<int64_t>(width, N - n0);
          for (int r = 0; r < rows; ++r) {
            T* orow = op + (r0 + r) * so + n0;
            const float* a = acc + r * acc_row;
            for (int64_t j = 0; j < valid; ++j) {
              const float b = bias ? static_cast<float>(bias[n0 + j]) : 0.f;
              const float sum = scale ? a[j] * scale[n0 + j] : a[j];
              orow[j] = static_cast<T>(sum + b);
            }
          }
        };
        if (blocks == kTileBlocks) {
          k.template product<kTileVecs>(rows, r0, block0, acc);
          emit(block0 * kPackN, kTileBlocks * kPackN, kTileVecs * kV);
        } else {
          for (int64_t b = block0; b < block0 + blocks; ++b) {
            k.template product<kBlockVecs>(rows, r0, b, acc);
            emit(b * kPackN, kPackN, kBlockVecs * kV);
          }
        }
      }
    }
  });
}

// Slabs of W (T, int8, fp8) widened on load.
template <typename W>
struct SlabKernel {
  const float* x;  // [M, K] fp32
  const W* w;      // [num_blocks, K, 16]
  int64_t K;

  void prepare(int64_t, int64_t) {}
  template <int NV>
  void product(int rows, int64_t r0, int64_t block, float* acc) const {
    tile_rows<W, NV>(rows, x + r0 * K, K, w + block * K * kPackN, K * kPackN, K, acc);
  }
};

// x, packed [ceil(N / 16), K, 16] (`slab_k` rows of 16 per block) and bias, as every op needs.
inline void check_skinny_args(const at::Tensor& x, const at::Tensor& packed,
                              const std::optional<at::Tensor>& bias, int64_t out_features,
                              int64_t slab_k) {
  TORCH_CHECK(x.dim() == 2, "skinny_linear: x must be [rows, in_features]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPackN && packed.is_contiguous(),
              "skinny_linear: the weight must be packed as [ceil(N / 16), in_features, 16]");
  TORCH_CHECK(packed.size(1) == slab_k, "skinny_linear: in_features differ (x ", x.size(1),
              ", weight slabs of ", packed.size(1), " rows)");
  TORCH_CHECK(out_features > (packed.size(0) - 1) * kPackN &&
                  out_features <= packed.size(0) * kPackN,
              "skinny_linear: out_features does not match the packed blocks");
  check_inner_contiguous(x, "x");
  TORCH_CHECK(packed.device().is_cpu(), "skinny_linear: the weight must be a CPU tensor");
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "skinny_linear: bias must be [out_features], contiguous, of x's dtype");
  }
}

// Runs `kernel` (built by make(x as fp32 [M, K])) over every row of x: the shared body of the ops.
template <typename Make>
at::Tensor skinny_op(const at::Tensor& x, int64_t num_blocks,
                     const std::optional<at::Tensor>& bias, int64_t out_features,
                     const float* scale, Make make) {
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return out;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  FOLIO_DISPATCH(x.scalar_type(), "skinny_linear", [&] {
    run_skinny<scalar_t>(make(xf.data_ptr<float>()), x.size(0), num_blocks,
                         bias ? bias->data_ptr<scalar_t>() : nullptr, scale, out);
  });
  return out;
}

}  // namespace folio_cpu
