// Prefill attention straight from the paged cache: sequences with one or more query tokens
// (a prompt, a chunk of one after a cached prefix) attending causally to their cached keys.
// Query row j of sequence s sits at position p = seq_lens[s] - q_len + j and sees keys 0..p, or
// with a sliding window (window > 0) keys p - window + 1..p.
//
// One work item is (sequence, KV head, tile of up to kTileQ query positions): its rows are the
// tile's positions times the KV head's group of query heads, so each K/V row loaded serves every
// row of the tile. Flash-style: key tiles of kTileK rows (widened to fp32, K transposed), scores
// by a register-blocked product, an online softmax per row (running max and sum, the output
// rescaled when the max moves), then P.V into fp32 accumulators. An item's key tiles start at
// the window of its first row (0 without one): keys outside a row's own range are masked, keys
// below the item's first window and positions past seq_lens[s] are never read (blocks wholly
// below a window may have been freed and reused). Items are claimed from a shared counter,
// costliest first, so uneven tiles (later positions see more keys) balance across threads.
// Variants, as twins.paged_attention defines them: softcap > 0 maps each scaled score s to
// softcap * tanh(s / softcap) before masking; sinks ([num_heads] fp32) adds one logit per query
// head to the softmax's denominator only (softmax_norm in vec.h). A quantized cache (KT = int8
// or float8 e4m3fn) is widened on load and each row multiplied by its scale (KVScales, vec.h):
// the tiles hold code * scale in fp32, as kernels/kv_quant.py defines the values.

#include <atomic>

#include "vec.h"

namespace folio_cpu {

constexpr int64_t kTileQ = 16;      // query positions per work item
constexpr int kKeyVecs = 4;         // key tile = kKeyVecs vectors of scores per row
constexpr int64_t kTileK = kKeyVecs * kV;
constexpr int kRows = 4;            // rows per register block

struct PrefillItem {
  int64_t seq, head, q0, nq, cost;
};

// s[r, :] = q[r, :] . kt[:, :] for NR rows: kKeyVecs score vectors per row in registers.
template <int NR>
inline void score_rows(const float* q, int64_t dim, const float* kt, float* s) {
  fVec acc[NR][kKeyVecs];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < kKeyVecs; ++c) acc[r][c] = fVec(0.f);
  for (int64_t d = 0; d < dim; ++d) {
    fVec k[kKeyVecs];
    for (int c = 0; c < kKeyVecs; ++c) k[c] = fVec::loadu(kt + d * kTileK + c * kV);
    for (int r = 0; r < NR; ++r) {
      const fVec qv(q[r * dim + d]);
      for (int c = 0; c < kKeyVecs; ++c) acc[r][c] = at::vec::fmadd(qv, k[c], acc[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < kKeyVecs; ++c) acc[r][c].store(s + r * kTileK + c * kV);
}

// acc[r, j0:j0+NV*kV] += sum_t p[r, t] * v[t, j0:...] for NR rows over nk keys.
template <int NR, int NV>
inline void weigh_rows(const float* p, const float* v, int64_t dim, int64_t nk, int64_t j0,
                       float* acc) {
  fVec a[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NV; ++c) a[r][c] = fVec::loadu(acc + r * dim + j0 + c * kV);
  for (int64_t t = 0; t < nk; ++t) {
    fVec vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = fVec::loadu(v + t * dim + j0 + c * kV);
    for (int r = 0; r < NR; ++r) {
      const fVec w(p[r * kTileK + t]);
      for (int c = 0; c < NV; ++c) a[r][c] = at::vec::fmadd(w, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NV; ++c) a[r][c].store(acc + r * dim + j0 + c * kV);
}

template <int NR>
inline void weigh_block(const float* p, const float* v, int64_t dim, int64_t nk, float* acc) {
  int64_t j = 0;
  for (; j + 4 * kV <= dim; j += 4 * kV) weigh_rows<NR, 4>(p, v, dim, nk, j, acc);
  for (; j < dim; j += kV) weigh_rows<NR, 1>(p, v, dim, nk, j, acc);
}

template <typename Fn>
inline void by_row_blocks(int64_t rows, Fn&& fn) {  // fn(first row, std::integral_constant NR)
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) fn(r, std::integral_constant<int, kRows>{});
  switch (rows - r) {
    case 3: fn(r, std::integral_constant<int, 3>{}); break;
    case 2: fn(r, std::integral_constant<int, 2>{}); break;
    case 1: fn(r, std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

template <typename T, typename KT>
void prefill_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                            const at::Tensor& seq_ids, double scale, int64_t window,
                            double softcap, const float* sinks, KVScales ks, KVScales vs) {
  const int64_t num_heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv = k_cache.size(2);
  const int64_t group = num_heads / num_kv, num_cache_blocks = k_cache.size(0);
  const int64_t max_blocks = block_tables.size(1), sbt = block_tables.stride(0);
  const int64_t kb = k_cache.stride(0), kt = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vt = v_cache.stride(1), vh = v_cache.stride(2);
  const int64_t sq0 = q.stride(0), sq1 = q.stride(1), so0 = out.stride(0), so1 = out.stride(1);
  const T* qp = q.data_ptr<T>();
  const KT* kp = k_cache.data_ptr<KT>();
  const KT* vp = v_cache.data_ptr<KT>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* ids = seq_ids.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  // The first key a query at position `pos` sees.
  const auto window_start = [window](int64_t pos) {
    return window > 0 ? std::max<int64_t>(0, pos - window + 1) : int64_t{0};
  };
  const int64_t num_tokens = q.size(0), num_seqs = seq_lens.numel();

  std::vector<PrefillItem> items;
  for (int64_t i = 0; i < seq_ids.numel(); ++i) {
    const int64_t s = ids[i];
    TORCH_CHECK(s >= 0 && s < num_seqs, "seq_ids[", i, "] = ", s, " is not a sequence");
    const int64_t q_start = qsl[s], q_len = qsl[s + 1] - q_start, len = lens[s];
    TORCH_CHECK(q_start >= 0 && q_len >= 1 && q_start + q_len <= num_tokens,
                "sequence ", s, " has query rows [", q_start, ", ", q_start + q_len, ")");
    TORCH_CHECK(len >= q_len && len <= max_blocks * block_size, "seq_lens[", s, "] = ", len,
                " is outside [", q_len, ", ", max_blocks * block_size, "]");
    for (int64_t q0 = 0; q0 < q_len; q0 += kTileQ) {
      const int64_t nq = std::min(kTileQ, q_len - q0), first_pos = len - q_len + q0;
      const int64_t cost = nq * (first_pos + nq - window_start(first_pos));
      for (int64_t h = 0; h < num_kv; ++h) items.push_back({s, h, q0, nq, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const PrefillItem& a, const PrefillItem& b) { return a.cost > b.cost; });
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};

  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1,
                   [&](int64_t, int64_t) {
    const int64_t max_rows = kTileQ * group;
    std::vector<float> qf(max_rows * dim), acc(max_rows * dim), m(max_rows), l(max_rows);
    std::vector<float> krows(kTileK * dim), ktile(dim * kTileK), vtile(kTileK * dim);
    std::vector<float> s(max_rows * kTileK);
    for (int64_t w; (w = next.fetch_add(1)) < num_items;) {
      const PrefillItem& it = items[w];
      const int64_t q_len = qsl[it.seq + 1] - qsl[it.seq];
      const int64_t first_pos = lens[it.seq] - q_len + it.q0;  // of the tile's first row
      const int64_t rows = it.nq * group, num_keys = first_pos + it.nq;
      const int32_t* row_bt = bt + it.seq * sbt;
      // Row r = i * group + g: position first_pos + i, query head h * group + g.
      for (int64_t i = 0; i < it.nq; ++i) {
        for (int64_t g = 0; g < group; ++g) {
          const T* src = qp + (qsl[it.seq] + it.q0 + i) * sq0 + (it.head * group + g) * sq1;
          float* dst = qf.data() + (i * group + g) * dim;
          for (int64_t j = 0; j < dim; j += kV) (load_f(src + j) * fVec(fscale)).store(dst + j);
        }
      }
      std::fill(m.begin(), m.begin() + rows, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + rows, 0.f);
      std::fill(acc.begin(), acc.begin() + rows * dim, 0.f);
      // Keys k_start .. num_keys - 1: the first row's window to the last row's position.
      for (int64_t k0 = window_start(first_pos); k0 < num_keys; k0 += kTileK) {
        const int64_t nk = std::min(kTileK, num_keys - k0);
        for (int64_t t = 0; t < kTileK; ++t) {  // rows past nk are zeros (their scores masked)
          float* kd = krows.data() + t * dim;
          float* vd = vtile.data() + t * dim;
          if (t < nk) {
            const int64_t pos = k0 + t, blk = row_bt[pos / block_size];
            TORCH_CHECK(blk >= 0 && blk < num_cache_blocks, "block id ", blk, " out of range");
            const int64_t off = blk * kb + (pos % block_size) * kt;
            const KT* ksrc = kp + off + it.head * kh;
            const KT* vsrc = vp + blk * vb + (pos % block_size) * vt + it.head * vh;
            if (ks.data == nullptr) {
              for (int64_t j = 0; j < dim; j += kV) {
                load_f(ksrc + j).store(kd + j);
                load_f(vsrc + j).store(vd + j);
              }
            } else {
              const fVec kscale(ks.at(blk, pos % block_size, it.head));
              const fVec vscale(vs.at(blk, pos % block_size, it.head));
              for (int64_t j = 0; j < dim; j += kV) {
                (load_f(ksrc + j) * kscale).store(kd + j);
                (load_f(vsrc + j) * vscale).store(vd + j);
              }
            }
          } else {
            std::fill(kd, kd + dim, 0.f);
            std::fill(vd, vd + dim, 0.f);
          }
        }
        at::vec::transpose_mxn<float>(krows.data(), dim, ktile.data(), kTileK, kTileK, dim);
        by_row_blocks(rows, [&](int64_t r, auto nr) {
          score_rows<decltype(nr)::value>(qf.data() + r * dim, dim, ktile.data(),
                                          s.data() + r * kTileK);
        });
        // Online softmax: row r sees this tile's keys [k0 + from, k0 + to): from its window's
        // start to its position.
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t pos = first_pos + r / group;
          const int64_t from = std::max<int64_t>(0, window_start(pos) - k0);
          const int64_t to = std::min(pos - k0 + 1, nk);
          float* sr = s.data() + r * kTileK;
          if (to <= from) {  // the row sees no key of this tile
            std::fill(sr, sr + kTileK, 0.f);
            continue;
          }
          if (cap > 0.f) softcap_scores(sr, kTileK, cap);  // before the mask's -inf
          for (int64_t t = 0; t < from; ++t) sr[t] = -std::numeric_limits<float>::infinity();
          for (int64_t t = to; t < kTileK; ++t) sr[t] = -std::numeric_limits<float>::infinity();
          fVec mx = fVec::loadu(sr);
          for (int c = 1; c < kKeyVecs; ++c) mx = at::vec::maximum(mx, fVec::loadu(sr + c * kV));
          const float tile_max = at::vec::vec_reduce_all<float>(
              [](fVec& x, fVec& y) { return at::vec::maximum(x, y); }, mx);
          const float m_new = std::max(m[r], tile_max);
          const float alpha = std::exp(m[r] - m_new);
          const fVec mv(m_new);
          fVec sum(0.f);
          for (int c = 0; c < kKeyVecs; ++c) {
            const fVec e = (fVec::loadu(sr + c * kV) - mv).exp();
            e.store(sr + c * kV);
            sum = sum + e;
          }
          l[r] = l[r] * alpha + hsum(sum);
          m[r] = m_new;
          if (alpha != 1.f) {
            float* ar = acc.data() + r * dim;
            for (int64_t j = 0; j < dim; j += kV) (fVec::loadu(ar + j) * fVec(alpha)).store(ar + j);
          }
        }
        by_row_blocks(rows, [&](int64_t r, auto nr) {
          weigh_block<decltype(nr)::value>(s.data() + r * kTileK, vtile.data(), dim, nk,
                                           acc.data() + r * dim);
        });
      }
      for (int64_t i = 0; i < it.nq; ++i) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = i * group + g;
          const int64_t hd = it.head * group + g;
          T* dst = op + (qsl[it.seq] + it.q0 + i) * so0 + hd * so1;
          const fVec inv(softmax_norm(m[r], l[r], sinks ? sinks + hd : nullptr));
          for (int64_t j = 0; j < dim; j += kV) store_f(dst + j, fVec::loadu(acc.data() + r * dim + j) * inv);
        }
      }
    }
  });
}

void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& block_tables,
                       const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                       const at::Tensor& seq_ids, double scale, int64_t window, double softcap,
                       const std::optional<at::Tensor>& sinks,
                       const std::optional<at::Tensor>& k_scale,
                       const std::optional<at::Tensor>& v_scale) {
  check_attention_operands(out, q, k_cache, v_cache, k_scale, v_scale);
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be >= 0 (0: off)");
  const float* sink = sinks_data(sinks, q.size(1));
  TORCH_CHECK(q.size(2) % kV == 0, "head_dim must be a multiple of ", kV);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1, "block_tables must be [num_seqs, max_blocks] int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.numel() == block_tables.size(0), "seq_lens must be [num_seqs] int32");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous() &&
                  query_start_loc.numel() == seq_lens.numel() + 1,
              "query_start_loc must be [num_seqs + 1] int32");
  TORCH_CHECK(seq_ids.scalar_type() == at::kInt && seq_ids.is_contiguous() && seq_ids.dim() == 1,
              "seq_ids must be [num_prefills] int32");
  const KVScales ks = kv_scales(k_scale), vs = kv_scales(v_scale);
  FOLIO_DISPATCH(q.scalar_type(), "prefill_attention", [&] {
    FOLIO_DISPATCH_KV(k_cache.scalar_type(), scalar_t, [&] {
      prefill_attention_impl<scalar_t, kv_t>(out, q, k_cache, v_cache, block_tables,
                                             query_start_loc, seq_lens, seq_ids, scale, window,
                                             softcap, sink, ks, vs);
    });
  });
}

}  // namespace folio_cpu
