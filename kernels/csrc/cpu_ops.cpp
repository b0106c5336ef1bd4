// Fused CPU kernels for the executor's hot loop, registered as torch.ops.folio_cpu.*.
//
// Built on first use by kernels/cpu_ext.py (torch.utils.cpp_extension, no pybind) with the
// vector ISA of the machine it runs on (CPU_CAPABILITY = AVX512, AVX2 or DEFAULT), and
// checked against the torch twins in tests/kernels/test_cpu_ext.py.
//
// Invariants shared by every kernel here:
// - Math in fp32; inputs of 16-bit dtypes are widened on load and rounded (to nearest even)
//   only where the twin rounds, so a bf16 result matches the twin's rounding points.
// - The innermost dimension of every tensor argument is contiguous (checked); outer strides
//   are passed through, so strided views (q inside the fused qkv output) need no copy.
// - Work is split with at::parallel_for over torch's intra-op threads, with grains sized so
//   small batches stay on one thread rather than paying a fork/join.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

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

void check_inner_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, " must have a contiguous last dimension");
}

// ---------------------------------------------------------------------------------------------
// rms_norm, optionally with the residual add fused: the twin's rounding points are
//   x <- round(x + residual)                     (the new residual stream)
//   out = round(weight * round(x * rsqrt(mean(x^2) + eps)))

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                   at::Tensor& out, at::Tensor& new_residual, double eps, bool has_residual) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const int64_t vec_end = hidden - hidden % kV;
  const T* xp = x.data_ptr<T>();
  const T* rp = has_residual ? residual.data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* nrp = has_residual ? new_residual.data_ptr<T>() : nullptr;
  const int64_t sx = x.stride(0), sr = has_residual ? residual.stride(0) : 0;
  const int64_t so = out.stride(0), snr = has_residual ? new_residual.stride(0) : 0;
  at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(hidden);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * sx;
      fVec acc(0.f);
      float acc_s = 0.f;
      int64_t i = 0;
      for (; i < vec_end; i += kV) {
        fVec v = load_f(xr + i);
        if (has_residual) {
          v = round_f<T>(v + load_f(rp + r * sr + i));
          store_f(nrp + r * snr + i, v);
        }
        v.store(buf.data() + i);
        acc = at::vec::fmadd(v, v, acc);
      }
      for (; i < hidden; ++i) {
        float v = static_cast<float>(xr[i]);
        if (has_residual) {
          v = round_s<T>(v + static_cast<float>(rp[r * sr + i]));
          nrp[r * snr + i] = static_cast<T>(v);
        }
        buf[i] = v;
        acc_s += v * v;
      }
      const float inv = 1.f / std::sqrt((hsum(acc) + acc_s) / static_cast<float>(hidden) +
                                        static_cast<float>(eps));
      const fVec inv_v(inv);
      T* orow = op + r * so;
      for (i = 0; i < vec_end; i += kV) {
        fVec h = round_f<T>(fVec::loadu(buf.data() + i) * inv_v);
        store_f(orow + i, load_f(wp + i) * h);
      }
      for (; i < hidden; ++i) {
        orow[i] = static_cast<T>(static_cast<float>(wp[i]) * round_s<T>(buf[i] * inv));
      }
    }
  });
}

std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                 const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2, "x must be [num_tokens, hidden]");
  check_inner_contiguous(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight must have x's dtype");
  const bool has_residual = residual.has_value();
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor new_residual, res;
  if (has_residual) {
    res = *residual;
    TORCH_CHECK(res.sizes() == x.sizes() && res.scalar_type() == x.scalar_type(),
                "residual must be shaped like x, with its dtype");
    check_inner_contiguous(res, "residual");
    new_residual = at::empty(x.sizes(), x.options());
  }
  FOLIO_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(x, res, weight, out, new_residual, eps, has_residual);
  });
  if (has_residual) return {out, new_residual};
  return {out};
}

// ---------------------------------------------------------------------------------------------
// silu_and_mul over a [gate | up] row: out = round(round(silu(gate)) * up), silu in fp32 as
// torch computes it (x / (1 + exp(-x)), Sleef's exp), tails through the same vector code.

template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  const int64_t vec_end = inter - inter % kV;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t sx = x.stride(0), so = out.stride(0);
  const fVec one(1.f);
  auto act_mul = [&](const fVec& g, const fVec& u) {
    return round_f<T>(g / (one + g.neg().exp())) * u;
  };
  at::parallel_for(0, rows, grain_rows(inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = xp + r * sx;
      const T* u = g + inter;
      T* o = op + r * so;
      for (int64_t i = 0; i < vec_end; i += kV) store_f(o + i, act_mul(load_f(g + i), load_f(u + i)));
      if (vec_end < inter) {
        const int64_t n = inter - vec_end;
        float gb[kV] = {0.f}, ub[kV] = {0.f}, ob[kV];
        for (int64_t i = 0; i < n; ++i) {
          gb[i] = static_cast<float>(g[vec_end + i]);
          ub[i] = static_cast<float>(u[vec_end + i]);
        }
        act_mul(fVec::loadu(gb), fVec::loadu(ub)).store(ob);
        for (int64_t i = 0; i < n; ++i) o[vec_end + i] = static_cast<T>(ob[i]);
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [num_tokens, 2 * intermediate]");
  check_inner_contiguous(x, "x");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  FOLIO_DISPATCH(x.scalar_type(), "silu_and_mul",
                                  [&] { silu_and_mul_impl<scalar_t>(x, out); });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Neox rotary embedding in place on q and k, with the twin's rounding: the fp32 cos and sin
// rounded to the activation dtype, then y1 = round(round(x1*c) - round(x2*s)),
//                                        y2 = round(round(x2*c) + round(x1*s)).

template <typename T>
inline void rotate_head(T* x, const float* cs, int64_t half) {
  const int64_t vec_end = half - half % kV;
  int64_t i = 0;
  for (; i < vec_end; i += kV) {
    fVec c = round_f<T>(fVec::loadu(cs + i)), s = round_f<T>(fVec::loadu(cs + half + i));
    fVec x1 = load_f(x + i), x2 = load_f(x + half + i);
    fVec y1 = round_f<T>(x1 * c) - round_f<T>(x2 * s);
    fVec y2 = round_f<T>(x2 * c) + round_f<T>(x1 * s);
    store_f(x + i, y1);
    store_f(x + half + i, y2);
  }
  for (; i < half; ++i) {
    float c = round_s<T>(cs[i]), s = round_s<T>(cs[half + i]);
    float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[half + i]);
    x[i] = static_cast<T>(round_s<T>(x1 * c) - round_s<T>(x2 * s));
    x[half + i] = static_cast<T>(round_s<T>(x2 * c) + round_s<T>(x1 * s));
  }
}

template <typename T>
void rotary_impl(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                 const at::Tensor& cos_sin) {
  const int64_t num_tokens = q.size(0), hq = q.size(1), hk = k.size(1), dim = q.size(2);
  const int64_t half = dim / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cs = cos_sin.data_ptr<float>();
  const int64_t scs = cos_sin.stride(0), max_pos = cos_sin.size(0);
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const int64_t sq0 = q.stride(0), sq1 = q.stride(1), sk0 = k.stride(0), sk1 = k.stride(1);
  at::parallel_for(0, num_tokens, grain_rows((hq + hk) * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside the cache");
      const float* row = cs + pos[t] * scs;
      for (int64_t h = 0; h < hq; ++h) rotate_head(qp + t * sq0 + h * sq1, row, half);
      for (int64_t h = 0; h < hk; ++h) rotate_head(kp + t * sk0 + h * sk1, row, half);
    }
  });
}

// cos_sin: the model's fp32 cache [max_position, head_dim], cos | sin halves.
void rotary(const at::Tensor& positions, at::Tensor q, at::Tensor k, const at::Tensor& cos_sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "q, k must be [num_tokens, heads, head_dim]");
  TORCH_CHECK(q.size(2) % 2 == 0 && cos_sin.dim() == 2 && cos_sin.size(1) == q.size(2),
              "cache must be [max_pos, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == q.size(0), "positions must be [num_tokens] int64");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k must share a dtype");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat, "the cos/sin cache must be float32");
  check_inner_contiguous(q, "q");
  check_inner_contiguous(k, "k");
  check_inner_contiguous(cos_sin, "cos_sin");
  FOLIO_DISPATCH(q.scalar_type(), "rotary",
                 [&] { rotary_impl<scalar_t>(positions, q, k, cos_sin); });
}

// ---------------------------------------------------------------------------------------------
// Decode attention straight from the paged cache: one query token per sequence, attending to
// its first seq_lens[s] cached positions. One work item is (sequence, KV head): its group of
// query heads shares every K/V row it loads. Scores and softmax in fp32, exact max-subtracted
// softmax over the whole context (two passes over K: scores, then P·V); positions past
// seq_lens[s] are never read, so stale or poisoned slots cannot leak.

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
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q, out must be [num_seqs, heads, dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "caches must be [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "head_dim must match the cache");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  out.scalar_type() == q.scalar_type(), "q, caches and out must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.size(0) == q.size(0) && block_tables.stride(1) == 1,
              "block_tables must be [num_seqs, max_blocks] int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.numel() == q.size(0), "seq_lens must be [num_seqs] int32");
  check_inner_contiguous(q, "q");
  check_inner_contiguous(k_cache, "k_cache");
  check_inner_contiguous(v_cache, "v_cache");
  check_inner_contiguous(out, "out");
  FOLIO_DISPATCH(q.scalar_type(), "decode_attention", [&] {
    decode_attention_impl<scalar_t>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
  });
}

}  // namespace

TORCH_LIBRARY(folio_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> Tensor[]");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos_sin) -> ()");
  m.def("decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(folio_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
  m.impl("decode_attention", &decode_attention);
}
