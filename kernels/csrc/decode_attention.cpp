// Decode attention straight from the paged cache: one query token per sequence, attending to
// its first seq_lens[s] cached positions. One work item is (sequence, KV head): its group of
// query heads shares every K/V row it loads. Scores and softmax in fp32, exact max-subtracted
// softmax over the whole context (a pass over K for the scores, one over V); positions past
// seq_lens[s] are never read, so stale or poisoned slots cannot leak.

#include "vec.h"

namespace folio_cpu {

// Ask for a cache row's lines ahead of use: sequences' blocks are scattered, so the hardware
// prefetcher loses the stream at every block boundary.
template <typename T>
inline void prefetch_row(const T* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b);
}

// acc[g] = sum_t p[g, t] * v_t over one (sequence, KV head)'s value rows, for head_dim =
// NV * kV: two query heads at a time with their accumulators in registers.
template <int NV, typename T>
void weighted_rows(const T* vbase, const int32_t* row_bt, int64_t block_size, int64_t vb,
                   int64_t vt, int64_t len, const float* probs, int64_t group, float* acc) {
  constexpr int64_t kAhead = 8;
  for (int64_t g = 0; g < group; g += 2) {
    const bool two = g + 1 < group;
    const float* p0 = probs + g * len;
    const float* p1 = two ? p0 + len : p0;
    fVec a0[NV], a1[NV];
    for (int j = 0; j < NV; ++j) a0[j] = a1[j] = fVec(0.f);
    for (int64_t t = 0; t < len; ++t) {
      const T* vrow = vbase + row_bt[t / block_size] * vb + (t % block_size) * vt;
      if (g == 0 && t + kAhead < len) {
        const int64_t ta = t + kAhead;
        prefetch_row(vbase + row_bt[ta / block_size] * vb + (ta % block_size) * vt, NV * kV);
      }
      const fVec w0(p0[t]), w1(p1[t]);
      for (int j = 0; j < NV; ++j) {
        const fVec v = load_f(vrow + j * kV);
        a0[j] = at::vec::fmadd(w0, v, a0[j]);
        a1[j] = at::vec::fmadd(w1, v, a1[j]);
      }
    }
    for (int j = 0; j < NV; ++j) {
      a0[j].store(acc + g * NV * kV + j * kV);
      if (two) a1[j].store(acc + (g + 1) * NV * kV + j * kV);
    }
  }
}

template <typename T>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv = k_cache.size(2);
  const int64_t group = num_heads / num_kv;
  const int64_t max_blocks = block_tables.size(1), sbt = block_tables.stride(0);
  const int64_t kb = k_cache.stride(0), kt = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vt = v_cache.stride(1), vh = v_cache.stride(2);
  const int64_t sq0 = q.stride(0), sq1 = q.stride(1), so0 = out.stride(0), so1 = out.stride(1);
  const int64_t num_cache_blocks = k_cache.size(0);
  const int64_t vec_end = dim - dim % kV;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, num_seqs * num_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), kf(dim), scores;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t s = w / num_kv, h = w % num_kv;
      const int64_t len = lens[s];
      TORCH_CHECK(len >= 1 && len <= max_blocks * block_size, "seq_lens[", s, "] = ", len,
                  " is outside [1, ", max_blocks * block_size, "]");
      for (int64_t g = 0; g < group; ++g) {
        const T* qrow = qp + s * sq0 + (h * group + g) * sq1;
        float* qg = qf.data() + g * dim;
        int64_t j = 0;
        for (; j < vec_end; j += kV) (load_f(qrow + j) * fVec(fscale)).store(qg + j);
        for (; j < dim; ++j) qg[j] = static_cast<float>(qrow[j]) * fscale;
      }
      scores.resize(group * len);
      const int32_t* row_bt = bt + s * sbt;
      // Pass 1: scores[g, t] = scale * q_g . k_t, up to kV tokens of one block at a time (the
      // next ones prefetched meanwhile); each key row widened once and shared by the group.
      for (int64_t t0 = 0; t0 < len;) {
        const int64_t blk = row_bt[t0 / block_size], off = t0 % block_size;
        TORCH_CHECK(blk >= 0 && blk < num_cache_blocks, "block id ", blk, " out of range");
        const int64_t n = std::min<int64_t>({kV, block_size - off, len - t0});
        if (t0 + n < len) {  // the next tile's rows
          const int64_t t1 = t0 + n, n1 = std::min<int64_t>({kV, block_size - t1 % block_size, len - t1});
          const T* next = kp + row_bt[t1 / block_size] * kb + (t1 % block_size) * kt + h * kh;
          for (int64_t l = 0; l < n1; ++l) prefetch_row(next + l * kt, dim);
        }
        const T* rows = kp + blk * kb + off * kt + h * kh;
        for (int64_t l = 0; l < n; ++l) {
          const T* krow = rows + l * kt;
          int64_t j = 0;
          for (; j < vec_end; j += kV) load_f(krow + j).store(kf.data() + j);
          for (; j < dim; ++j) kf[j] = static_cast<float>(krow[j]);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * dim;
            fVec s0(0.f), s1(0.f);  // two chains: half the FMA latency per dot
            j = 0;
            for (; j + 2 * kV <= vec_end; j += 2 * kV) {
              s0 = at::vec::fmadd(fVec::loadu(qg + j), fVec::loadu(kf.data() + j), s0);
              s1 = at::vec::fmadd(fVec::loadu(qg + j + kV), fVec::loadu(kf.data() + j + kV), s1);
            }
            for (; j < vec_end; j += kV)
              s0 = at::vec::fmadd(fVec::loadu(qg + j), fVec::loadu(kf.data() + j), s0);
            float tail = 0.f;
            for (; j < dim; ++j) tail += qg[j] * kf[j];
            scores[g * len + t0 + l] = hsum(s0 + s1) + tail;
          }
        }
        t0 += n;
      }
      // Softmax per query head; probabilities stay unnormalised until the end.
      std::vector<float> inv_sum(group);
      for (int64_t g = 0; g < group; ++g) {
        float* sc = scores.data() + g * len;
        fVec mx(-std::numeric_limits<float>::infinity());
        int64_t t = 0;
        for (; t + kV <= len; t += kV) mx = at::vec::maximum(mx, fVec::loadu(sc + t));
        float m = at::vec::vec_reduce_all<float>(
            [](fVec& x, fVec& y) { return at::vec::maximum(x, y); }, mx);
        for (; t < len; ++t) m = std::max(m, sc[t]);
        const fVec mv(m);
        fVec sum_v(0.f);
        float sum_s = 0.f;
        for (t = 0; t + kV <= len; t += kV) {
          fVec e = (fVec::loadu(sc + t) - mv).exp();
          e.store(sc + t);
          sum_v = sum_v + e;
        }
        for (; t < len; ++t) {
          sc[t] = std::exp(sc[t] - m);
          sum_s += sc[t];
        }
        inv_sum[g] = 1.f / (hsum(sum_v) + sum_s);
      }
      // Pass 2: out_g = sum_t p[g, t] v_t / sum_t p[g, t]
      constexpr int64_t kAhead = 8;
      for (int64_t t = 0; t < std::min(len, kAhead); ++t)
        prefetch_row(vp + row_bt[t / block_size] * vb + (t % block_size) * vt + h * vh, dim);
      const T* vbase = vp + h * vh;
      if (dim == 4 * kV) {
        weighted_rows<4>(vbase, row_bt, block_size, vb, vt, len, scores.data(), group, acc.data());
      } else if (dim == 8 * kV) {
        weighted_rows<8>(vbase, row_bt, block_size, vb, vt, len, scores.data(), group, acc.data());
      } else {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t t = 0; t < len; ++t) {
          const T* vrow = vbase + row_bt[t / block_size] * vb + (t % block_size) * vt;
          if (t + kAhead < len) {
            const int64_t ta = t + kAhead;
            prefetch_row(vbase + row_bt[ta / block_size] * vb + (ta % block_size) * vt, dim);
          }
          int64_t j = 0;
          for (; j < vec_end; j += kV) {
            const fVec v = load_f(vrow + j);
            for (int64_t g = 0; g < group; ++g) {
              float* a = acc.data() + g * dim + j;
              at::vec::fmadd(fVec(scores[g * len + t]), v, fVec::loadu(a)).store(a);
            }
          }
          for (; j < dim; ++j) {
            const float v = static_cast<float>(vrow[j]);
            for (int64_t g = 0; g < group; ++g) acc[g * dim + j] += scores[g * len + t] * v;
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* orow = op + s * so0 + (h * group + g) * so1;
        const float* a = acc.data() + g * dim;
        int64_t j = 0;
        for (; j < vec_end; j += kV) store_f(orow + j, fVec::loadu(a + j) * fVec(inv_sum[g]));
        for (; j < dim; ++j) orow[j] = static_cast<T>(a[j] * inv_sum[g]);
      }
    }
  });
}

void decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, double scale) {
  check_attention_operands(out, q, k_cache, v_cache);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.size(0) == q.size(0) && block_tables.stride(1) == 1,
              "block_tables must be [num_seqs, max_blocks] int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.numel() == q.size(0), "seq_lens must be [num_seqs] int32");
  FOLIO_DISPATCH(q.scalar_type(), "decode_attention", [&] {
    decode_attention_impl<scalar_t>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
  });
}

}  // namespace folio_cpu
