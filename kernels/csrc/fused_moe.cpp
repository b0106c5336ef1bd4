// The mixture-of-experts MLP for decode-sized batches (kernels.cpu.fused_moe_packed; the torch
// twin is twins.fused_moe): out[t] = sum_s w[t, s] * (w2[e] @ act(w13[e] @ x[t] + b13[e]) +
// b2[e]), e = ids[t, s].
//
// The experts' weights are packed once at load into the skinny kernels' 16-feature slabs
// (skinny.h; kernels/cpu.py pack_moe_weights):
//   w13 [E, 2 * ceil(I / 16), H, 16]: for each block b of 16 intermediate features, the gate
//       slab of features [16b, 16b + 16) then the up slab of the same features (zero past I);
//   w2  [E, ceil(H / 16), I, 16]: 16 hidden features per slab.
// Only the experts the step touches are read. The (token, slot) pairs are counting-sorted by
// expert (stable: token order within an expert) and their rows gathered, so an expert's rows
// are contiguous; then three passes:
//   1. gate/up: tiles of (expert, block): the block's gate and up slabs streamed once against
//      the expert's rows, bias and activation applied, act[row] kept in fp32;
//   2. down: tiles of (expert, up to 4 blocks of hidden features) of w2 against act, bias
//      added, y[row] fp32;
//   3. the weighted sum over a token's slots, in slot order, rounded to x's dtype once.
// Each output is an in-order fp32 sum over k (skinny.h's outer products), so a pair's result
// depends on its own token only, never on the other tokens of the step or on the thread that
// computed it (tiles are claimed from a shared counter): batch and thread invariant.

#include "skinny.h"

namespace folio_cpu {
namespace {

inline float activate(float gate, float up, bool oai, float limit, float alpha) {
  if (!oai) return gate / (1.f + std::exp(-gate)) * up;  // silu(gate) * up
  gate = std::min(gate, limit);
  up = std::min(std::max(up, -limit), limit);
  return (up + 1.f) * (gate * (1.f / (1.f + std::exp(-(gate * alpha)))));
}

// Runs body(expert, unit) over every (touched expert, unit in [0, units)), claimed from a
// shared counter by torch's intra-op threads.
template <typename Body>
void for_expert_units(const std::vector<int64_t>& experts, int64_t units, Body body) {
  const int64_t num_tiles = static_cast<int64_t>(experts.size()) * units;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tiles), 1,
                   [&](int64_t, int64_t) {
    for (int64_t t = next++; t < num_tiles; t = next++) body(experts[t / units], t % units);
  });
}

}  // namespace

at::Tensor fused_moe_packed(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                            const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                            const std::optional<at::Tensor>& w13_bias,
                            const std::optional<at::Tensor>& w2_bias, int64_t activation,
                            double swiglu_limit, double swiglu_alpha, int64_t intermediate) {
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 4 && w2.dim() == 4,
              "fused_moe_packed: x [T, H], w13 [E, 2 * ceil(I / 16), H, 16], "
              "w2 [E, ceil(H / 16), I, 16]");
  const int64_t T = x.size(0), H = x.size(1), E = w13.size(0), I = intermediate;
  const int64_t nb = (I + kPackN - 1) / kPackN, nbh = (H + kPackN - 1) / kPackN;
  TORCH_CHECK(I > 0 && w13.size(1) == 2 * nb && w13.size(2) == H && w13.size(3) == kPackN &&
                  w2.size(0) == E && w2.size(1) == nbh && w2.size(2) == I &&
                  w2.size(3) == kPackN,
              "fused_moe_packed: w13 must be [E, 2 * ceil(I / 16), H, 16] and w2 "
              "[E, ceil(H / 16), I, 16] for H ", H, " and I ", I);
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous(),
              "fused_moe_packed: weights must be contiguous");
  TORCH_CHECK(w13.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type(),
              "fused_moe_packed: x and the weights must share a dtype");
  check_inner_contiguous(x, "x");
  TORCH_CHECK(w13.device().is_cpu() && w2.device().is_cpu(), "fused_moe_packed: CPU weights");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T && topk_ids.is_contiguous() &&
                  topk_ids.scalar_type() == at::kLong && topk_ids.device().is_cpu(),
              "fused_moe_packed: topk_ids must be [T, k] int64, contiguous");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.is_contiguous() &&
                  topk_weights.scalar_type() == at::kFloat && topk_weights.device().is_cpu(),
              "fused_moe_packed: topk_weights must be [T, k] fp32, contiguous");
  TORCH_CHECK(activation == 0 || activation == 1,
              "fused_moe_packed: activation 0 (silu) or 1 (swigluoai)");
  const auto check_bias = [&](const std::optional<at::Tensor>& b, int64_t n, const char* name) {
    if (!b) return;
    TORCH_CHECK(b->dim() == 2 && b->size(0) == E && b->size(1) == n && b->is_contiguous() &&
                    b->scalar_type() == x.scalar_type() && b->device().is_cpu(),
                "fused_moe_packed: ", name, " must be [E, ", n, "], contiguous, of x's dtype");
  };
  check_bias(w13_bias, 2 * I, "w13_bias");
  check_bias(w2_bias, H, "w2_bias");
  const int64_t K = topk_ids.size(1), P = T * K;
  at::Tensor out = at::empty({T, H}, x.options());
  if (T == 0) return out;

  // Counting sort of the pairs by expert; where[p]: pair p's row in the sorted order.
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  std::vector<int64_t> start(E + 1, 0), where(P);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < E, "fused_moe_packed: expert id ", ids[p],
                " out of range");
    ++start[ids[p] + 1];
  }
  std::vector<int64_t> experts;  // the touched ones, ascending
  for (int64_t e = 0; e < E; ++e) {
    if (start[e + 1]) experts.push_back(e);
    start[e + 1] += start[e];
  }
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < P; ++p) where[p] = fill[ids[p]]++;
  }
  // xs[row] = the pair's token's row, fp32, in sorted order.
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // [T, H]
  std::vector<float> xs(P * H), act(P * I), y(P * H);
  {
    const float* xp = xf.data_ptr<float>();
    for (int64_t p = 0; p < P; ++p)
      std::copy(xp + (p / K) * H, xp + (p / K + 1) * H, xs.data() + where[p] * H);
  }
  const float* tw = topk_weights.data_ptr<float>();
  const bool oai = activation == 1;
  const float limit = static_cast<float>(swiglu_limit), alpha = static_cast<float>(swiglu_alpha);

  FOLIO_DISPATCH(x.scalar_type(), "fused_moe_packed", [&] {
    const scalar_t* w13p = w13.data_ptr<scalar_t>();
    const scalar_t* w2p = w2.data_ptr<scalar_t>();
    const scalar_t* b13 = w13_bias ? w13_bias->data_ptr<scalar_t>() : nullptr;
    const scalar_t* b2 = w2_bias ? w2_bias->data_ptr<scalar_t>() : nullptr;
    const int64_t slab13 = H * kPackN, slab2 = I * kPackN;
    // 1. act[row, j] = act(gate_j . x + b, up_j . x + b): one block's gate and up slabs.
    constexpr int kPairVecs = 2 * kBlockVecs;  // the gate block's vectors, then the up block's
    for_expert_units(experts, nb, [&](int64_t e, int64_t b) {
      alignas(64) float acc[kRowChunk * kPairVecs * kV];
      const scalar_t* w = w13p + (e * 2 * nb + 2 * b) * slab13;
      const int64_t j0 = b * kPackN, width = std::min<int64_t>(kPackN, I - j0);
      for (int64_t r0 = start[e]; r0 < start[e + 1]; r0 += kRowChunk) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowChunk, start[e + 1] - r0));
        tile_rows<scalar_t, kPairVecs>(rows, xs.data() + r0 * H, H, w, slab13, H, acc);
        for (int r = 0; r < rows; ++r) {
          const float* a = acc + r * kPairVecs * kV;  // gate [0, 16), up [16, 32)
          for (int64_t j = 0; j < width; ++j) {
            const float bg = b13 ? static_cast<float>(b13[e * 2 * I + j0 + j]) : 0.f;
            const float bu = b13 ? static_cast<float>(b13[e * 2 * I + I + j0 + j]) : 0.f;
            act[(r0 + r) * I + j0 + j] =
                activate(a[j] + bg, a[kPackN + j] + bu, oai, limit, alpha);
          }
        }
      }
    });
    // 2. y[row, n] = w2_n . act[row] + b2[n], kTileBlocks blocks of hidden features a tile.
    const int64_t tiles = (nbh + kTileBlocks - 1) / kTileBlocks;
    for_expert_units(experts, tiles, [&](int64_t e, int64_t t) {
      alignas(64) float acc[kRowChunk * kTileVecs * kV];
      const int64_t block0 = t * kTileBlocks, blocks = std::min<int64_t>(kTileBlocks, nbh - block0);
      for (int64_t r0 = start[e]; r0 < start[e + 1]; r0 += kRowChunk) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowChunk, start[e + 1] - r0));
        const float* a = act.data() + r0 * I;
        // Each pass leaves `width` features from n0 in acc[r][0, width), rows acc_row apart.
        auto emit = [&](int64_t n0, int64_t acc_row) {
          const int64_t width = std::min<int64_t>(acc_row, H - n0);
          for (int r = 0; r < rows; ++r)
            for (int64_t n = 0; n < width; ++n)
              y[(r0 + r) * H + n0 + n] =
                  acc[r * acc_row + n] + (b2 ? static_cast<float>(b2[e * H + n0 + n]) : 0.f);
        };
        if (blocks == kTileBlocks) {
          tile_rows<scalar_t, kTileVecs>(rows, a, I, w2p + (e * nbh + block0) * slab2, slab2, I,
                                         acc);
          emit(block0 * kPackN, kTileVecs * kV);
        } else {
          for (int64_t b = block0; b < block0 + blocks; ++b) {
            tile_rows<scalar_t, kBlockVecs>(rows, a, I, w2p + (e * nbh + b) * slab2, slab2, I,
                                            acc);
            emit(b * kPackN, kBlockVecs * kV);
          }
        }
      }
    });
    // 3. out[t] = sum over slots, in slot order, of weight * y, rounded once.
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, grain_rows(H * K), [&](int64_t t0, int64_t t1) {
      std::vector<float> sum(H);
      for (int64_t t = t0; t < t1; ++t) {
        std::fill(sum.begin(), sum.end(), 0.f);
        for (int64_t s = 0; s < K; ++s) {
          const float w = tw[t * K + s];
          const float* yr = y.data() + where[t * K + s] * H;
          for (int64_t n = 0; n < H; ++n) sum[n] += w * yr[n];
        }
        for (int64_t n = 0; n < H; ++n) op[t * H + n] = static_cast<scalar_t>(sum[n]);
      }
    });
  });
  return out;
}

}  // namespace folio_cpu
