// The mixture-of-experts MLP for decode-sized batches (kernels.fused_moe; the torch twin is
// twins.fused_moe): out[t] = sum_s w[t, s] * (w2[e] @ act(w13[e] @ x[t] + b13[e]) + b2[e]),
// e = ids[t, s].
//
// Only the experts the step touches are read. The (token, slot) pairs are counting-sorted by
// expert (stable: token order within an expert), then three passes:
//   1. gate/up: tiles of (expert, 16 intermediate features); each feature's gate and up rows
//      of w13 are streamed once and dotted with every pair routed to that expert (the rows
//      stay in L1 across the pairs), bias and activation applied, act[pair] kept in fp32;
//   2. down: tiles of (expert, 16 hidden features) of w2 against act, bias added, y[pair] fp32;
//   3. the weighted sum over a token's slots, in slot order, rounded to x's dtype once.
// Weights stay in their checkpoint layout ([E, 2I, H] and [E, H, I], rows contiguous): each
// output element is one row's dot product, vector lanes over the row then a fixed horizontal
// sum and a scalar tail, in fp32 (16-bit weights widened on load). A pair's result therefore
// depends on its own token only, never on the other tokens of the step or on the thread that
// computed it (tiles are claimed from a shared counter): batch and thread invariant.

#include <atomic>

#include "vec.h"

namespace folio_cpu {
namespace {

constexpr int64_t kMoeTile = 16;  // features per tile
constexpr int64_t kPrefetchBytes = 512;  // how far ahead each weight row is prefetched
constexpr int kMoeRows = kV >= 16 ? 4 : 2;  // pairs per pass: 4 weight rows x this many
                                             // accumulators (16 registers at most)

// sums[i][r] = <ws[i][0, K), xs[r][0, K)> for NR weight rows and R pairs (fp32 rows): NR * R
// independent accumulator chains (one per dot product: each sums in the same order whatever NR
// and R), every weight vector widened once and used R times.
template <typename W, int NR, int R>
inline void dot_rows(const W* const* ws, const float* const* xs, int64_t K, float* sums) {
  fVec acc[NR][R];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = fVec(0.f);
  int64_t k = 0;
  for (; k + kV <= K; k += kV) {
    fVec xv[R];
    for (int r = 0; r < R; ++r) xv[r] = fVec::loadu(xs[r] + k);
    for (int i = 0; i < NR; ++i) {
      __builtin_prefetch(ws[i] + k + kPrefetchBytes / sizeof(W));
      const fVec wv = load_f(ws[i] + k);
      for (int r = 0; r < R; ++r) acc[i][r] = at::vec::fmadd(xv[r], wv, acc[i][r]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[i][r]);
      for (int64_t j = k; j < K; ++j) s += static_cast<float>(ws[i][j]) * xs[r][j];
      sums[i * kMoeRows + r] = s;
    }
}

template <typename W, int NR>
inline void dot_any(int rows, const W* const* ws, const float* const* xs, int64_t K,
                    float* sums) {
  switch (rows) {
    case 1: return dot_rows<W, NR, 1>(ws, xs, K, sums);
    case 2: return dot_rows<W, NR, 2>(ws, xs, K, sums);
    case 3: if constexpr (kMoeRows >= 3) return dot_rows<W, NR, 3>(ws, xs, K, sums); break;
    case 4: if constexpr (kMoeRows >= 4) return dot_rows<W, NR, 4>(ws, xs, K, sums); break;
  }
  TORCH_CHECK(false, "fused_moe: bad row chunk ", rows);
}

// NR (8) weight rows against one or two pairs: 8 or 16 chains.
template <typename W, int NR>
inline void dot_few(int rows, const W* const* ws, const float* const* xs, int64_t K,
                    float* sums) {
  if (rows == 1) return dot_rows<W, NR, 1>(ws, xs, K, sums);
  dot_rows<W, NR, 2>(ws, xs, K, sums);
}

inline float activate(float gate, float up, bool oai, float limit, float alpha) {
  if (!oai) return gate / (1.f + std::exp(-gate)) * up;  // silu(gate) * up
  gate = std::min(gate, limit);
  up = std::min(std::max(up, -limit), limit);
  return (up + 1.f) * (gate * (1.f / (1.f + std::exp(-(gate * alpha)))));
}

// Runs body(expert, feature0, features) over every (touched expert, tile of `N` features),
// tiles claimed from a shared counter.
template <typename Body>
void for_expert_tiles(const std::vector<int64_t>& experts, int64_t N, Body body) {
  const int64_t per_expert = (N + kMoeTile - 1) / kMoeTile;
  const int64_t num_tiles = static_cast<int64_t>(experts.size()) * per_expert;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tiles), 1,
                   [&](int64_t, int64_t) {
    for (int64_t t = next++; t < num_tiles; t = next++) {
      const int64_t n0 = (t % per_expert) * kMoeTile;
      body(experts[t / per_expert], n0, std::min<int64_t>(kMoeTile, N - n0));
    }
  });
}

}  // namespace

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                     const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                     const std::optional<at::Tensor>& w13_bias,
                     const std::optional<at::Tensor>& w2_bias, int64_t activation,
                     double swiglu_limit, double swiglu_alpha) {
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3,
              "fused_moe: x [T, H], w13 [E, 2I, H], w2 [E, H, I]");
  const int64_t T = x.size(0), H = x.size(1), E = w13.size(0), I = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == H && w2.size(0) == E && w2.size(1) == H,
              "fused_moe: w13 must be [E, 2I, H] and w2 [E, H, I]");
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous(), "fused_moe: weights must be contiguous");
  TORCH_CHECK(w13.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type(),
              "fused_moe: x and the weights must share a dtype");
  check_inner_contiguous(x, "x");
  TORCH_CHECK(w13.device().is_cpu() && w2.device().is_cpu(), "fused_moe: CPU weights");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T && topk_ids.is_contiguous() &&
                  topk_ids.scalar_type() == at::kLong && topk_ids.device().is_cpu(),
              "fused_moe: topk_ids must be [T, k] int64, contiguous");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.is_contiguous() &&
                  topk_weights.scalar_type() == at::kFloat && topk_weights.device().is_cpu(),
              "fused_moe: topk_weights must be [T, k] fp32, contiguous");
  TORCH_CHECK(activation == 0 || activation == 1, "fused_moe: activation 0 (silu) or 1 (swigluoai)");
  const auto check_bias = [&](const std::optional<at::Tensor>& b, int64_t n, const char* name) {
    if (!b) return;
    TORCH_CHECK(b->dim() == 2 && b->size(0) == E && b->size(1) == n && b->is_contiguous() &&
                    b->scalar_type() == x.scalar_type() && b->device().is_cpu(),
                "fused_moe: ", name, " must be [E, ", n, "], contiguous, of x's dtype");
  };
  check_bias(w13_bias, 2 * I, "w13_bias");
  check_bias(w2_bias, H, "w2_bias");
  const int64_t K = topk_ids.size(1), P = T * K;
  at::Tensor out = at::empty({T, H}, x.options());
  if (T == 0) return out;

  // Counting sort of the pairs by expert; where[p]: pair p's row in the sorted order.
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  std::vector<int64_t> start(E + 1, 0), pairs(P), where(P);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < E, "fused_moe: expert id ", ids[p], " out of range");
    ++start[ids[p] + 1];
  }
  std::vector<int64_t> experts;  // the touched ones, ascending
  for (int64_t e = 0; e < E; ++e) {
    if (start[e + 1]) experts.push_back(e);
    start[e + 1] += start[e];
  }
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < P; ++p) {
      where[p] = fill[ids[p]]++;
      pairs[where[p]] = p;
    }
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // [T, H]
  const float* xp = xf.data_ptr<float>();
  std::vector<float> act(P * I), y(P * H);  // by sorted row
  const float* tw = topk_weights.data_ptr<float>();
  const bool oai = activation == 1;
  const float limit = static_cast<float>(swiglu_limit), alpha = static_cast<float>(swiglu_alpha);

  FOLIO_DISPATCH(x.scalar_type(), "fused_moe", [&] {
    const scalar_t* w13p = w13.data_ptr<scalar_t>();
    const scalar_t* w2p = w2.data_ptr<scalar_t>();
    const scalar_t* b13 = w13_bias ? w13_bias->data_ptr<scalar_t>() : nullptr;
    const scalar_t* b2 = w2_bias ? w2_bias->data_ptr<scalar_t>() : nullptr;
    // 1. act[row, j] = act(gate_j . x + b, up_j . x + b) for the expert's rows.
    for_expert_tiles(experts, I, [&](int64_t e, int64_t j0, int64_t width) {
      const int64_t r_begin = start[e], r_end = start[e + 1];
      // Two features at a time (four for one or two pairs): their gate and up rows.
      const bool few = r_end - r_begin <= 2;
      for (int64_t j = j0; j < j0 + width;) {
        const int nj = few && j + 3 < j0 + width ? 4 : (j + 1 < j0 + width ? 2 : 1);
        const scalar_t* ws[8];
        for (int i = 0; i < nj; ++i) {
          ws[2 * i] = w13p + (e * 2 * I + j + i) * H;  // gate row j + i
          ws[2 * i + 1] = ws[2 * i] + I * H;           // up row j + i
        }
        for (int64_t r0 = r_begin; r0 < r_end; r0 += kMoeRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kMoeRows, r_end - r0));
          const float* xs[kMoeRows];
          for (int r = 0; r < rows; ++r) xs[r] = xp + (pairs[r0 + r] / K) * H;
          float sums[8 * kMoeRows];
          if (nj == 4) {
            dot_few<scalar_t, 8>(rows, ws, xs, H, sums);
          } else if (nj == 2) {
            dot_any<scalar_t, 4>(rows, ws, xs, H, sums);
          } else {
            dot_any<scalar_t, 2>(rows, ws, xs, H, sums);
          }
          for (int i = 0; i < nj; ++i) {
            const float bg = b13 ? static_cast<float>(b13[e * 2 * I + j + i]) : 0.f;
            const float bu = b13 ? static_cast<float>(b13[e * 2 * I + I + j + i]) : 0.f;
            for (int r = 0; r < rows; ++r)
              act[(r0 + r) * I + j + i] =
                  activate(sums[2 * i * kMoeRows + r] + bg,
                           sums[(2 * i + 1) * kMoeRows + r] + bu, oai, limit, alpha);
          }
        }
        j += nj;
      }
    });
    // 2. y[row, n] = w2_n . act[row] + b2[n].
    for_expert_tiles(experts, H, [&](int64_t e, int64_t n0, int64_t width) {
      const int64_t r_begin = start[e], r_end = start[e + 1];
      const bool few = r_end - r_begin <= 2;
      for (int64_t n = n0; n < n0 + width;) {
        const int nn = static_cast<int>(std::min<int64_t>(few ? 8 : 4, n0 + width - n));
        const scalar_t* ws[8];
        for (int i = 0; i < nn; ++i) ws[i] = w2p + (e * H + n + i) * I;
        for (int64_t r0 = r_begin; r0 < r_end; r0 += kMoeRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kMoeRows, r_end - r0));
          const float* as[kMoeRows];
          for (int r = 0; r < rows; ++r) as[r] = act.data() + (r0 + r) * I;
          float sums[8 * kMoeRows];
          if (nn == 8) {
            dot_few<scalar_t, 8>(rows, ws, as, I, sums);
          } else if (nn == 4) {
            dot_any<scalar_t, 4>(rows, ws, as, I, sums);
          } else {
            for (int i = 0; i < nn; ++i) dot_any<scalar_t, 1>(rows, ws + i, as, I, sums + i * kMoeRows);
          }
          for (int i = 0; i < nn; ++i) {
            const float b = b2 ? static_cast<float>(b2[e * H + n + i]) : 0.f;
            for (int r = 0; r < rows; ++r) y[(r0 + r) * H + n + i] = sums[i * kMoeRows + r] + b;
          }
        }
        n += nn;
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
