// Decode attention straight from the paged cache: one query token per sequence, at position
// seq_lens[s] - 1, attending to the keys it sees: positions lo..seq_lens[s] - 1, where lo = 0,
// or seq_lens[s] - window with a sliding window (window > 0).
//
// A work item is one chunk of kChunk positions of one sequence, all heads: it walks its blocks
// front to back in tiles of up to 16 positions, reading each tile's K rows and then its V rows
// whole (every KV head side by side, so the reads stream through contiguous memory), with an
// online softmax per query head in fp32 (running max, rescaled sums). A sequence with more than
// one chunk of visible positions is split across items and its chunks' partial results merged
// in chunk order. The chunking depends only on the sequence's own length (and the window), so a
// sequence's result does not depend on the rest of the batch nor on the thread count.
//
// Only positions lo..seq_lens[s] - 1 are read: slots past the length and every block below the
// window (which the block manager may have freed and handed to another sequence) are never
// touched, so stale or poisoned slots cannot leak and a windowed decode costs the window, not
// the context. Variants, as twins.paged_attention defines them: softcap > 0 maps each scaled
// score s to softcap * tanh(s / softcap) before the softmax; sinks ([num_heads] fp32) adds one
// logit per query head to the softmax's denominator only (the max taken over it too).
//
// A quantized cache (KT = int8 or float8 e4m3fn, q and out 16-bit or fp32) is widened to fp32
// on load (an e4m3 tile once per KV head, into scratch its query heads share); a key's scale (kscale[blk, off, h], fp32, any strides: static per-head scales come as
// a stride-0 view) multiplies its scores, a value's scale its softmax weights before P.V, so
// the result is attention over code * scale (kernels/kv_quant.py), in another rounding order.

#include <atomic>

#include "vec.h"

namespace folio_cpu {

namespace {

constexpr int64_t kChunk = 256;  // positions per work item
constexpr int64_t kTile = 16;    // positions scored together
constexpr int64_t kAhead = 2;    // tiles prefetched ahead

inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b);
}

#if defined(CPU_CAPABILITY_AVX512)
// The 16 lane-sums of v[0..15] in one vector; the accumulators come in the order `slot` gives
// (row l in v[slot(l)]) so that lane l ends up holding row l's sum.
constexpr int slot(int l) { return (l % 4) * 4 + l / 4; }

inline __m512 reduce16(const __m512* v) {
  __m512 u[8], w[4];
  for (int i = 0; i < 8; ++i)  // 128-bit lanes [a0+a2, a1+a3, b0+b2, b1+b3]
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // lane j: the 4 partial sums of input 4i + j
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  const __m512 z0 = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
  const __m512 z1 = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
  return _mm512_add_ps(_mm512_shuffle_ps(z0, z1, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(z0, z1, _MM_SHUFFLE(3, 2, 3, 2)));
}
#endif

// out[l] = q . k_l for the n <= 16 rows at krows (row stride kt); q is fp32, pre-scaled.
template <typename T>
inline void score_tile(const float* q, const T* krows, int64_t kt, int64_t n, int64_t dim,
                       float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  if (dim % kV == 0) {
    __m512 acc[kTile];
    for (int l = 0; l < kTile; ++l) acc[l] = _mm512_setzero_ps();
    for (int64_t j = 0; j < dim; j += kV) {
      const __m512 qv = fVec::loadu(q + j);
      for (int l = 0; l < kTile; ++l)
        if (l < n) acc[slot(l)] = _mm512_fmadd_ps(qv, load_f(krows + l * kt + j), acc[slot(l)]);
    }
    _mm512_storeu_ps(out, reduce16(acc));
    return;
  }
#endif
  const int64_t vec_end = dim - dim % kV;
  for (int64_t l = 0; l < n; ++l) {
    const T* k = krows + l * kt;
    fVec s(0.f);
    int64_t j = 0;
    for (; j < vec_end; j += kV) s = at::vec::fmadd(fVec::loadu(q + j), load_f(k + j), s);
    float tail = 0.f;
    for (; j < dim; ++j) tail += q[j] * static_cast<float>(k[j]);
    out[l] = hsum(s) + tail;
  }
}

// acc[g] += sum_l p[g][l] * v_l for the group's heads (p rows kTile apart, acc rows dim apart).
template <int NV, typename T>
inline void weigh_tile(const float* p, const T* vrows, int64_t vt, int64_t n, int64_t group,
                       float* acc) {
  for (int64_t g = 0; g < group; g += 2) {
    const bool two = g + 1 < group;
    const float* p0 = p + g * kTile;
    const float* p1 = two ? p0 + kTile : p0;
    float* a0p = acc + g * NV * kV;
    float* a1p = two ? a0p + NV * kV : a0p;
    fVec a0[NV], a1[NV];
    for (int j = 0; j < NV; ++j) {
      a0[j] = fVec::loadu(a0p + j * kV);
      a1[j] = fVec::loadu(a1p + j * kV);
    }
    for (int64_t l = 0; l < n; ++l) {
      const T* v = vrows + l * vt;
      const fVec w0(p0[l]), w1(p1[l]);
      for (int j = 0; j < NV; ++j) {
        const fVec x = load_f(v + j * kV);
        a0[j] = at::vec::fmadd(w0, x, a0[j]);
        a1[j] = at::vec::fmadd(w1, x, a1[j]);
      }
    }
    for (int j = 0; j < NV; ++j) {
      a0[j].store(a0p + j * kV);
      if (two) a1[j].store(a1p + j * kV);
    }
  }
}

template <typename T>
inline void weigh_tile_any(const float* p, const T* vrows, int64_t vt, int64_t n, int64_t group,
                           int64_t dim, float* acc) {
  if (dim == 4 * kV) return weigh_tile<4>(p, vrows, vt, n, group, acc);
  if (dim == 8 * kV) return weigh_tile<8>(p, vrows, vt, n, group, acc);
  for (int64_t l = 0; l < n; ++l)
    for (int64_t g = 0; g < group; ++g)
      for (int64_t j = 0; j < dim; ++j)
        acc[g * dim + j] += p[g * kTile + l] * static_cast<float>(vrows[l * vt + j]);
}

// The n rows at rows (row stride rt) widened to fp32 into buf [n, dim]: exactly the values
// load_f gives, so scoring or weighing buf equals doing it on the rows, bit for bit.
template <typename T>
inline void widen_tile(const T* rows, int64_t rt, int64_t n, int64_t dim, float* buf) {
  const int64_t vec_end = dim - dim % kV;
  for (int64_t l = 0; l < n; ++l) {
    const T* r = rows + l * rt;
    float* b = buf + l * dim;
    int64_t j = 0;
    for (; j < vec_end; j += kV) load_f(r + j).store(b + j);
    for (; j < dim; ++j) b[j] = static_cast<float>(r[j]);
  }
}

// p[hd][x] *= scale of position off + x (x < n) of head hd's KV head, for every query head: the
// tile's n scales of a KV head gathered once, then one vector product per query head's row
// (lanes past n multiply by 0: those rows are overwritten or zero already).
inline void scale_tile(const KVScales& sc, int64_t blk, int64_t off, int64_t n, int64_t num_kv,
                       int64_t group, float* p) {
  alignas(64) float tile[kTile];
  for (int64_t h = 0; h < num_kv; ++h) {
    for (int64_t x = 0; x < kTile; ++x) tile[x] = x < n ? sc.at(blk, off + x, h) : 0.f;
    for (int64_t g = 0; g < group; ++g) {
      float* row = p + (h * group + g) * kTile;
      for (int64_t c = 0; c < kTile; c += kV)
        (fVec::loadu(row + c) * fVec::loadu(tile + c)).store(row + c);
    }
  }
}

}  // namespace

template <typename T, typename KT>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale, int64_t window,
                           double softcap, const float* sinks, KVScales ks, KVScales vs) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv = k_cache.size(2);
  const int64_t group = num_heads / num_kv;
  const int64_t max_blocks = block_tables.size(1), sbt = block_tables.stride(0);
  const int64_t kb = k_cache.stride(0), kt = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vt = v_cache.stride(1), vh = v_cache.stride(2);
  const int64_t sq0 = q.stride(0), sq1 = q.stride(1), so0 = out.stride(0), so1 = out.stride(1);
  const int64_t num_cache_blocks = k_cache.size(0);
  const int64_t row_bytes = num_kv * dim * static_cast<int64_t>(sizeof(KT));  // one position, all heads
  const T* qp = q.data_ptr<T>();
  const KT* kp = k_cache.data_ptr<KT>();
  const KT* vp = v_cache.data_ptr<KT>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  // Widening an e4m3 byte costs about eight vector operations (vec.h) where bf16 takes one
  // shift: an fp8 tile is widened once per KV head into fp32 and every query head of the group
  // reads that (from L1), rather than each widening it again.
  constexpr bool widen_once = std::is_same_v<KT, c10::Float8_e4m3fn>;

  // Work items (sequence, first position), longest sequences first; `lo[s]` is sequence s's
  // first visible position, where its chunks start; `first[s]` the index of its first chunk in
  // the partials, or -1 when it has one chunk.
  std::vector<std::pair<int64_t, int64_t>> items;
  std::vector<int64_t> first(num_seqs, -1), lo(num_seqs, 0);
  int64_t num_partials = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = lens[s];
    TORCH_CHECK(len >= 1 && len <= max_blocks * block_size, "seq_lens[", s, "] = ", len,
                " is outside [1, ", max_blocks * block_size, "]");
    if (window > 0) lo[s] = std::max<int64_t>(0, len - window);
    if (len - lo[s] > kChunk) {
      first[s] = num_partials;
      num_partials += (len - lo[s] + kChunk - 1) / kChunk;
    }
    for (int64_t t0 = lo[s]; t0 < len; t0 += kChunk) items.emplace_back(s, t0);
  }
  std::stable_sort(items.begin(), items.end(), [&](const auto& a, const auto& b) {
    return std::min<int64_t>(kChunk, lens[a.first] - a.second) >
           std::min<int64_t>(kChunk, lens[b.first] - b.second);
  });
  // Per chunk of a split sequence: acc [num_heads, dim], then max and sum [num_heads] each.
  const int64_t partial_size = num_heads * (dim + 2);
  std::vector<float> partials(num_partials * partial_size);
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1,
                   [&](int64_t, int64_t) {
    std::vector<float> qf(num_heads * dim), acc(num_heads * dim), m(num_heads), l(num_heads);
    std::vector<float> p(num_heads * kTile);
    std::vector<float> wide(widen_once ? kTile * dim : 0);  // one KV head's tile, widened
    for (int64_t i = next++; i < num_items; i = next++) {
      const auto [s, c0] = items[i];
      const int64_t c1 = std::min<int64_t>(c0 + kChunk, lens[s]);
      for (int64_t hd = 0; hd < num_heads; ++hd) {
        const T* qrow = qp + s * sq0 + hd * sq1;
        for (int64_t j = 0; j < dim; ++j) qf[hd * dim + j] = static_cast<float>(qrow[j]) * fscale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int32_t* row_bt = bt + s * sbt;
      int64_t ahead = c0;  // positions prefetched so far
      for (int64_t t = c0; t < c1;) {
        const int64_t blk = row_bt[t / block_size], off = t % block_size;
        TORCH_CHECK(blk >= 0 && blk < num_cache_blocks, "block id ", blk, " out of range");
        const int64_t n = std::min<int64_t>({kTile, block_size - off, c1 - t});
        // Rows up to kAhead tiles past this one, K and V, asked for while this tile computes.
        for (const int64_t want = std::min<int64_t>(c1, t + n + kAhead * kTile); ahead < want; ++ahead) {
          const int64_t b1 = row_bt[ahead / block_size], o1 = ahead % block_size;
          if (b1 >= 0 && b1 < num_cache_blocks) {
            prefetch_bytes(kp + b1 * kb + o1 * kt, row_bytes);
            prefetch_bytes(vp + b1 * vb + o1 * vt, row_bytes);
          }
        }
        const KT* krows = kp + blk * kb + off * kt;
        for (int64_t h = 0; h < num_kv; ++h) {
          const KT* rows = krows + h * kh;
          if (widen_once && group > 1) {  // the KV head's tile widened once for its group
            widen_tile(rows, kt, n, dim, wide.data());
            for (int64_t hd = h * group; hd < (h + 1) * group; ++hd)
              score_tile(qf.data() + hd * dim, wide.data(), dim, n, dim, p.data() + hd * kTile);
            continue;
          }
          for (int64_t hd = h * group; hd < (h + 1) * group; ++hd)
            score_tile(qf.data() + hd * dim, rows, kt, n, dim, p.data() + hd * kTile);
        }
        if (ks.data != nullptr) scale_tile(ks, blk, off, n, num_kv, group, p.data());
        for (int64_t hd = 0; hd < num_heads; ++hd) {  // online softmax, per query head
          float* ph = p.data() + hd * kTile;
          if (cap > 0.f) softcap_scores(ph, kTile, cap);  // before the padding's -inf
          std::fill(ph + n, ph + kTile, -std::numeric_limits<float>::infinity());
          fVec mx = fVec::loadu(ph);
          for (int64_t c = kV; c < kTile; c += kV) mx = at::vec::maximum(mx, fVec::loadu(ph + c));
          const float tile_max = at::vec::vec_reduce_all<float>(
              [](fVec& x, fVec& y) { return at::vec::maximum(x, y); }, mx);
          const float m_new = std::max(m[hd], tile_max);
          const float alpha = std::exp(m[hd] - m_new);
          const fVec mv(m_new);
          fVec sum(0.f);
          for (int64_t c = 0; c < kTile; c += kV) {
            const fVec e = (fVec::loadu(ph + c) - mv).exp();
            e.store(ph + c);
            sum = sum + e;
          }
          l[hd] = l[hd] * alpha + hsum(sum);
          m[hd] = m_new;
          if (alpha != 1.f) {
            float* a = acc.data() + hd * dim;
            for (int64_t j = 0; j < dim; ++j) a[j] *= alpha;
          }
        }
        const KT* vrows = vp + blk * vb + off * vt;
        // Each value's scale on its weights, after l summed them.
        if (vs.data != nullptr) scale_tile(vs, blk, off, n, num_kv, group, p.data());
        for (int64_t h = 0; h < num_kv; ++h) {
          // weigh_tile loads each value row once per pair of query heads.
          if (widen_once && group > 2) {
            widen_tile(vrows + h * vh, vt, n, dim, wide.data());
            weigh_tile_any(p.data() + h * group * kTile, wide.data(), dim, n, group, dim,
                           acc.data() + h * group * dim);
          } else {
            weigh_tile_any(p.data() + h * group * kTile, vrows + h * vh, vt, n, group, dim,
                           acc.data() + h * group * dim);
          }
        }
        t += n;
      }
      if (first[s] < 0) {
        for (int64_t hd = 0; hd < num_heads; ++hd) {
          T* orow = op + s * so0 + hd * so1;
          const float inv = softmax_norm(m[hd], l[hd], sinks ? sinks + hd : nullptr);
          for (int64_t j = 0; j < dim; ++j) orow[j] = static_cast<T>(acc[hd * dim + j] * inv);
        }
      } else {
        float* part = partials.data() + (first[s] + (c0 - lo[s]) / kChunk) * partial_size;
        std::copy(acc.begin(), acc.end(), part);
        std::copy(m.begin(), m.end(), part + num_heads * dim);
        std::copy(l.begin(), l.end(), part + num_heads * (dim + 1));
      }
    }
  });
  if (num_partials == 0) return;
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(dim);
    for (int64_t s = begin; s < end; ++s) {
      if (first[s] < 0) continue;
      const int64_t chunks = (lens[s] - lo[s] + kChunk - 1) / kChunk;
      const float* base = partials.data() + first[s] * partial_size;
      for (int64_t hd = 0; hd < num_heads; ++hd) {
        // A sink is one more logit of the softmax: in the max, and in the sum with no value.
        float m_all = sinks ? sinks[hd] : -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < chunks; ++c)
          m_all = std::max(m_all, base[c * partial_size + num_heads * dim + hd]);
        std::fill(acc.begin(), acc.end(), 0.f);
        float l_all = 0.f;
        for (int64_t c = 0; c < chunks; ++c) {  // in chunk order
          const float* part = base + c * partial_size;
          const float w = std::exp(part[num_heads * dim + hd] - m_all);
          l_all += w * part[num_heads * (dim + 1) + hd];
          for (int64_t j = 0; j < dim; ++j) acc[j] += w * part[hd * dim + j];
        }
        if (sinks) l_all += std::exp(sinks[hd] - m_all);
        T* orow = op + s * so0 + hd * so1;
        for (int64_t j = 0; j < dim; ++j) orow[j] = static_cast<T>(acc[j] / l_all);
      }
    }
  });
}

void decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, double scale, int64_t window, double softcap,
                      const std::optional<at::Tensor>& sinks,
                      const std::optional<at::Tensor>& k_scale,
                      const std::optional<at::Tensor>& v_scale) {
  check_attention_operands(out, q, k_cache, v_cache, k_scale, v_scale);
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be >= 0 (0: off)");
  const float* sink = sinks_data(sinks, q.size(1));
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.size(0) == q.size(0) && block_tables.stride(1) == 1,
              "block_tables must be [num_seqs, max_blocks] int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.numel() == q.size(0), "seq_lens must be [num_seqs] int32");
  const KVScales ks = kv_scales(k_scale), vs = kv_scales(v_scale);
  FOLIO_DISPATCH(q.scalar_type(), "decode_attention", [&] {
    FOLIO_DISPATCH_KV(k_cache.scalar_type(), scalar_t, [&] {
      decode_attention_impl<scalar_t, kv_t>(out, q, k_cache, v_cache, block_tables, seq_lens,
                                            scale, window, softcap, sink, ks, vs);
    });
  });
}

}  // namespace folio_cpu
