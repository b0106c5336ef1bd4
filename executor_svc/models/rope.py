"""Rotary position embedding tables.

Every RoPE variant we support differs only in its inverse frequencies, so the model builds one
`cos_sin_cache` `[max_position, head_dim]` (cos in the first half of the columns, sin in the
second) and the `kernels.rotary` op applies it, neox style.
"""

from __future__ import annotations

import math

import torch

from executor_svc.loading.model_config import RopeSpec


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


def inv_freq_for(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    if rope.params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    inv_freq = _default_inv_freq(rope.theta, head_dim)
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
                raise ValueError(f"rope freq_factors has {factors.numel()} entries; head_dim "
                                 f"{head_dim} needs {inv_freq.numel()}")
            return inv_freq / factors
        case other:
            raise ValueError(f"RoPE scaling type {other!r} is not supported "
                             "(supported: default, linear, llama3, freq_factors)")


def build_cos_sin_cache(rope: RopeSpec, head_dim: int, max_position: int,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """[max_position, head_dim] float32: cos(pos * inv_freq) | sin(pos * inv_freq)."""
    inv_freq = inv_freq_for(rope, head_dim)  # [head_dim // 2]
    positions = torch.arange(max_position, dtype=torch.int64, device="cpu").to(torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim // 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
