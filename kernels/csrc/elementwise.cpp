// rms_norm (with the residual add), silu_and_mul and rotary: one pass over each row.

#include "vec.h"

namespace folio_cpu {

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

}  // namespace folio_cpu
