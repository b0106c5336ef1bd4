// Linear layers on a few rows (decode batches): y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
//
// The weight is packed once (pack_skinny_weight, executor_svc/models/linear.py) as
// [ceil(N / 16), K, 16]: for each block of 16 output features, one slab holding, for every k,
// the 16 features' weights side by side (zero past N). A work tile is a few consecutive
// blocks; it streams their slabs front to back (memory bound: each weight element is read once
// per call, by one thread) and keeps rows x features accumulators in registers, an outer
// product per k: broadcast x[m, k], multiply by the 16-wide weight vector, accumulate in fp32.
// Rows beyond a chunk re-read the tile's slabs from cache rather than memory. 16-bit weights
// are widened on load; int8 weights (skinny_linear_q8, weight-only int8 with one fp32 scale
// per output feature) too, the scale applied to each feature's sum before the bias; the sum over k runs in order, in fp32, rounded to the output dtype
// once; tiles are claimed from a shared counter, so the result does not depend on which
// thread computes which tile.

#include <atomic>

#include "vec.h"

namespace folio_cpu {

namespace {

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

template <typename W, int NV>
inline void tile_rows(int rows, const float* x, int64_t x_stride, const W* w, int64_t slab,
                      int64_t K, float* out) {
  switch (rows) {
    case 1: return tile_product<W, 1, NV>(x, x_stride, w, slab, K, out);
    case 2: return tile_product<W, 2, NV>(x, x_stride, w, slab, K, out);
    case 3: return tile_product<W, 3, NV>(x, x_stride, w, slab, K, out);
    case 4: return tile_product<W, 4, NV>(x, x_stride, w, slab, K, out);
    default: TORCH_CHECK(false, "skinny_linear: bad row chunk ", rows);
  }
}

// T: x, bias and output; W: the packed weight (T, or int8 with `scale`).
template <typename T, typename W = T>
void skinny_linear_impl(const at::Tensor& xf, const at::Tensor& packed, const T* bias,
                        at::Tensor& out, const float* scale = nullptr) {
  const int64_t M = xf.size(0), K = xf.size(1), N = out.size(1);
  const int64_t num_blocks = packed.size(0), slab = K * kPackN;
  const int64_t num_tiles = (num_blocks + kTileBlocks - 1) / kTileBlocks;
  const float* xp = xf.data_ptr<float>();
  const W* wp = packed.data_ptr<W>();
  T* op = out.data_ptr<T>();
  const int64_t so = out.stride(0);
  // Tiles are claimed from a shared counter: a thread the OS preempts (the scheduler process
  // shares these cores) holds up one tile, not a fixed share of them.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tiles), 1,
                   [&](int64_t, int64_t) {
    alignas(64) float acc[kRowChunk * kTileVecs * kV];
    for (int64_t t = next++; t < num_tiles; t = next++) {
      const int64_t block0 = t * kTileBlocks;
      const int64_t blocks = std::min<int64_t>(kTileBlocks, num_blocks - block0);
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
          tile_rows<W, kTileVecs>(rows, xp + r0 * K, K, wp + block0 * slab, slab, K, acc);
          emit(block0 * kPackN, kTileBlocks * kPackN, kTileVecs * kV);
        } else {
          for (int64_t b = block0; b < block0 + blocks; ++b) {
            tile_rows<W, kBlockVecs>(rows, xp + r0 * K, K, wp + b * slab, slab, K, acc);
            emit(b * kPackN, kPackN, kBlockVecs * kV);
          }
        }
      }
    }
  });
}

void check_skinny_args(const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "skinny_linear: x must be [rows, in_features]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPackN && packed.is_contiguous(),
              "skinny_linear: the weight must be packed as [ceil(N / 16), in_features, 16]");
  TORCH_CHECK(packed.size(1) == x.size(1), "skinny_linear: in_features differ (x ", x.size(1),
              ", weight ", packed.size(1), ")");
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

}  // namespace

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias, int64_t out_features) {
  check_skinny_args(x, packed, bias, out_features);
  TORCH_CHECK(packed.scalar_type() == x.scalar_type(), "skinny_linear: x and weight dtypes differ");
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return out;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  FOLIO_DISPATCH(x.scalar_type(), "skinny_linear", [&] {
    skinny_linear_impl<scalar_t>(xf, packed, bias ? bias->data_ptr<scalar_t>() : nullptr, out);
  });
  return out;
}

at::Tensor skinny_linear_q8(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& scale, const std::optional<at::Tensor>& bias,
                            int64_t out_features) {
  check_skinny_args(x, packed, bias, out_features);
  TORCH_CHECK(packed.scalar_type() == at::kChar, "skinny_linear_q8: the weight must be int8");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == out_features && scale.is_contiguous() &&
                  scale.scalar_type() == at::kFloat && scale.device().is_cpu(),
              "skinny_linear_q8: scale must be [out_features] fp32, contiguous, on the CPU");
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return out;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  FOLIO_DISPATCH(x.scalar_type(), "skinny_linear_q8", [&] {
    skinny_linear_impl<scalar_t, int8_t>(xf, packed, bias ? bias->data_ptr<scalar_t>() : nullptr,
                                         out, scale.data_ptr<float>());
  });
  return out;
}

}  // namespace folio_cpu
