"""Rotary position embedding tables.

Every RoPE variant we support differs only in its inverse frequencies and a constant attention
factor on cos and sin, so the model builds one `cos_sin_cache` `[max_position, rotary_dim]` (cos
in the first half of the columns, sin in the second) and the `kernels.rotary` op applies it, neox
style, to the first rotary_dim dimensions of each head (all of them unless the config has
a ``partial_rotary_factor``; HF computes every type's frequencies for that width, as here). A row depends on the position alone, never on the batch or on the sequence's length, so
the table serves paged, chunked, batched and prefix-cached steps alike.

Two HF types choose their frequencies by the length of the sequence in the forward call
(``max(position_ids) + 1``), which a per-position table cannot see. Folio fixes the rule per
position instead, the rule HF itself follows while it decodes one token at a time:

- **longrope** (Phi-3): row p uses the short factors for p < original_max_position_embeddings
  and the long ones from there on. vLLM once switched a whole batch to the long factors when
  any token in it was past the original context (so one long request changed how its
  neighbours were rotated); it now uses the long factors at every position whenever
  max_model_len exceeds the original context, which differs from HF for short sequences too.
  Folio's rows depend on the position alone and follow HF's decode-time rule.
- **dynamic** (NTK): row p uses the base HF computes for a sequence of length
  max(p + 1, max_position_embeddings). vLLM builds one table for factor times the context
  with a single base for every position (its formula reduces to the unscaled base); Folio
  follows HF.

So for one sequence whose prompt fits in the original context Folio equals HF token for token,
also when generation runs past it (the tests check both). The divergence: a prompt longer than
the original context is rotated by HF, in its one prefill call, entirely with the long factors
(dynamic: with the base for the prompt's full length), while Folio rotates its first positions
with the short ones (the unscaled base). HF's choice depends on how the prompt is split into
calls, so no paged, chunked-prefill engine can reproduce it; vLLM does not either.
"""

from __future__ import annotations

import math

import torch

from checkpoints.rope import RopeSpec


def _default_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    # Explicit CPU device: the model may be built under a meta-device context.
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu")
    exponents = steps.to(torch.float32) / rotary_dim
    return 1.0 / (theta ** exponents)  # [rotary_dim // 2]


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth ramp
    between the two."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(rope: RopeSpec, rotary_dim: int) -> torch.Tensor:
    """YaRN: interpolate (divide by `factor`) the frequencies that turn fewer than `beta_slow`
    times over the original context, keep those that turn more than `beta_fast` times, and ramp
    linearly between them (by dimension index)."""
    params = rope.params
    factor = params["factor"]
    original = params["original_max_position_embeddings"]
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def dim_for(num_rotations: float) -> float:  # the dimension that turns that many times
        return (rotary_dim * math.log(original / (num_rotations * 2 * math.pi))
                / (2 * math.log(rope.theta)))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu") - low)
            / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    steps = torch.arange(0, rotary_dim, 2, device="cpu").to(torch.float32)
    pos_freqs = rope.theta ** (steps / rotary_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def _longrope_inv_freq(rope: RopeSpec, rotary_dim: int, key: str) -> torch.Tensor:
    factors = torch.tensor(rope.params[key], dtype=torch.float32, device="cpu")
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float()
    return 1.0 / (factors * rope.theta ** (steps / rotary_dim))  # [rotary_dim // 2]


def _dynamic_inv_freq(rope: RopeSpec, rotary_dim: int, positions: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK for each position p: the base HF computes for a sequence of p + 1 tokens,
    in float32 as HF does. positions [n] int64 -> [n, rotary_dim // 2]."""
    factor = rope.params["factor"]
    original = rope.params["original_max_position_embeddings"]
    seq_len = torch.clamp(positions + 1, min=original)  # [n]
    base = rope.theta * ((factor * seq_len / original) - (factor - 1)) ** (rotary_dim
                                                                            / (rotary_dim - 2))
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float()
    return 1.0 / (base[:, None] ** (steps / rotary_dim)[None, :])


def attention_factor(rope: RopeSpec) -> float:
    """The constant YaRN and LongRoPE multiply cos and sin by (1 for the other types)."""
    params = rope.params
    factor = params.get("factor", 1.0)
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    match rope.rope_type:
        case "yarn":
            def mscale(scale: float, m: float = 1) -> float:
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
            if params.get("mscale") and params.get("mscale_all_dim"):
                return float(mscale(factor, params["mscale"])
                             / mscale(factor, params["mscale_all_dim"]))
            return mscale(factor)
        case "longrope":
            if factor <= 1.0:
                return 1.0
            original = params["original_max_position_embeddings"]
            return math.sqrt(1 + math.log(factor) / math.log(original))
        case _:
            return 1.0


def inv_freq_for(rope: RopeSpec, rotary_dim: int) -> torch.Tensor:
    """[rotary_dim // 2]: the inverse frequencies within the original context (longrope: the
    short factors; dynamic: unscaled). `build_cos_sin_cache` applies the rest per position."""
    inv_freq = _default_inv_freq(rope.theta, rotary_dim)
    match rope.rope_type:
        case "default":
            return inv_freq
        case "linear":
            return inv_freq / rope.params["factor"]
        case "llama3":
            return _llama3_inv_freq(inv_freq, rope.params)
        case "freq_factors":  # a GGUF's rope_freqs tensor, llama.cpp's form of llama3 scaling
            factors = torch.tensor(rope.params["freq_factors"], dtype=torch.float32,
                                   device="cpu")
            if factors.shape != inv_freq.shape:
                raise ValueError(f"rope freq_factors has {factors.numel()} entries; rotary_dim "
                                 f"{rotary_dim} (the rotated part of each head) needs "
                                 f"{inv_freq.numel()}")
            return inv_freq / factors
        case "yarn":
            return _yarn_inv_freq(rope, rotary_dim)
        case "longrope":
            return _longrope_inv_freq(rope, rotary_dim, "short_factor")
        case "dynamic":
            return inv_freq
        case other:
            raise ValueError(f"RoPE scaling type {other!r} is not supported (supported: "
                             "default, linear, llama3, yarn, longrope, dynamic, freq_factors)")


def build_cos_sin_cache(rope: RopeSpec, rotary_dim: int, max_position: int,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """[max_position, rotary_dim] float32: a * cos(pos * inv_freq) | a * sin(pos * inv_freq), with
    a = `attention_factor(rope)` and inv_freq chosen per position (see the module docstring)."""
    positions = torch.arange(max_position, dtype=torch.int64, device="cpu")
    inv_freq = inv_freq_for(rope, rotary_dim)[None, :].expand(max_position, -1)
    if rope.rope_type in ("longrope", "dynamic"):
        original = rope.params["original_max_position_embeddings"]
        past = positions >= original  # HF's switch: sequence length p + 1 > original
        if rope.rope_type == "longrope":
            long = _longrope_inv_freq(rope, rotary_dim, "long_factor")
            inv_freq = torch.where(past[:, None], long[None, :], inv_freq)
        elif past.any():
            inv_freq = inv_freq.clone()
            inv_freq[past] = _dynamic_inv_freq(rope, rotary_dim, positions[past])
    freqs = positions.to(torch.float32)[:, None] * inv_freq  # [max_position, rotary_dim // 2]
    scale = attention_factor(rope)
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1).to(device)
