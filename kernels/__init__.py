"""Folio's kernels: Triton on CUDA, the CPU backend on the CPU, torch twins as the oracle.

Public entry points (the one dispatch point): store_kv, paged_attention, rms_norm, rotary,
silu_and_mul, w8a16_linear, group_quant_linear, fused_moe. Each picks the Triton launcher when its first tensor lives on a
CUDA device and the CPU implementation (kernels/cpu/) otherwise, so CPU runs never touch Triton. The torch
twins (kernels/twins.py) are the oracle both are tested against.

`FOLIO_KERNELS=triton` forces the Triton launchers for CPU tensors too; it needs
`TRITON_INTERPRET=1` in the environment before this package first launches a kernel (the
launcher modules are imported lazily, on first Triton use). `FOLIO_KERNELS=torch` forces the
twins everywhere, CPU included. Both are read once, at import.

Triton is optional: on machines without it (macOS) the package imports and the twins run.
"""

import functools
import os
from types import ModuleType

import torch

from kernels import cpu, cpu_ext, kv_quant, twins

_BACKEND = os.environ.get("FOLIO_KERNELS", "auto")
if _BACKEND not in ("auto", "torch", "triton"):
    raise ValueError(f"FOLIO_KERNELS must be auto, torch or triton, not {_BACKEND!r}")

__all__ = ["cpu", "cpu_backend_active", "cpu_ext", "fused_moe", "kv_quant", "group_quant_linear", "paged_attention", "rms_norm", "rotary", "silu_and_mul",
           "store_kv", "twins", "w8a16_linear"]


@functools.cache
def _triton() -> ModuleType:
    """The Triton launchers, imported on first use (needs triton; interpreter env set first)."""
    if _BACKEND == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "FOLIO_KERNELS=triton on a machine without CUDA needs TRITON_INTERPRET=1"
            )
    try:
        from kernels import triton_ops as ops
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise RuntimeError(f"Triton kernels need the triton package: {e}") from e
    return ops


def _use_triton(x: torch.Tensor) -> bool:
    if _BACKEND == "auto":
        return x.is_cuda
    return _BACKEND == "triton"


def cpu_backend_active(x: torch.Tensor) -> bool:
    """Whether ops on `x` run kernels/cpu/ (a CPU tensor, FOLIO_KERNELS auto)."""
    return _BACKEND == "auto" and not x.is_cuda


def _impl(x: torch.Tensor) -> ModuleType:
    if _use_triton(x):
        return _triton()
    return cpu if cpu_backend_active(x) else twins


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] at slot_mapping (-1 = skip); a
    quantized cache (fp8, int8) with its fp32 scales [num_blocks, block_size, num_kv_heads]
    (kernels/kv_quant.py: fp8's are read, int8's written)."""
    impl = _impl(key)
    impl.store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    out=None,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks=None,
    k_scale=None,
    v_scale=None,
) -> torch.Tensor:
    """Causal attention of a varlen query batch over the paged cache -> [num_tokens, num_heads,
    head_dim]. Variants (twins.paged_attention defines them): `window` > 0 limits a query to
    the last `window` keys, `softcap` > 0 caps the scores with tanh, `sinks` ([num_heads] fp32)
    adds one learned logit per head to the softmax. A quantized cache comes with its fp32
    scales `k_scale`, `v_scale` [num_blocks, block_size, num_kv_heads] (kernels/kv_quant.py)."""
    impl = _impl(q)
    return impl.paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        max_query_len, max_seq_len, scale, out, window=window, softcap=softcap, sinks=sinks,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


def rms_norm(x, weight, eps: float, residual=None):
    """out, or (out, new_residual) when residual is given; fp32 math, cast back to x.dtype."""
    impl = _impl(x)
    return impl.rms_norm(x, weight, eps, residual)


def rotary(positions, q, k, cos_sin_cache) -> None:
    """Neox-style rotary embedding applied in place to q and k, whose last dimension is the
    cache's width: whole heads, or (partial RoPE) strided views of each head's first columns."""
    impl = _impl(q)
    impl.rotary(positions, q, k, cos_sin_cache)


def fused_moe(x, w13, w2, topk_weights, topk_ids, **options) -> torch.Tensor:
    """Mixture-of-experts MLP: x [num_tokens, hidden], w13 [E, 2I, hidden] (gate | up rows),
    w2 [E, hidden, I], topk_weights [num_tokens, k] fp32, topk_ids [num_tokens, k] ->
    sum_k weight * expert(x), [num_tokens, hidden] in x's dtype. Options (twins.fused_moe):
    w13_bias, w2_bias, activation ("silu" | "swigluoai"), swiglu_limit, swiglu_alpha."""
    impl = _impl(x)
    return impl.fused_moe(x, w13, w2, topk_weights, topk_ids, **options)


def silu_and_mul(x) -> torch.Tensor:
    """[num_tokens, 2 * intermediate] -> silu(gate) * up, [num_tokens, intermediate]."""
    impl = _impl(x)
    return impl.silu_and_mul(x)


def w8a16_linear(x, weight, scale, bias) -> torch.Tensor:
    """x [num_tokens, K] @ (scale[:, None] * weight)^T + bias -> [num_tokens, N] in x's dtype;
    weight [N, K] int8 or float8_e4m3fn, scale [N] fp32 (executor_svc/quantization)."""
    impl = _impl(x)
    return impl.w8a16_linear(x, weight, scale, bias)


def group_quant_linear(x, qweight, scales, offsets, g_idx, group_size, bias) -> torch.Tensor:
    """x [num_tokens, K] @ W^T + bias with group-quantized 4/8-bit W (qweight uint8 nibbles
    [N, ceil(K/2)] or int8 [N, K], scales/offsets [N, G] fp32, g_idx [K] or None;
    executor_svc/quantization/grouped.py) -> [num_tokens, N] in x's dtype."""
    impl = _impl(x)
    return impl.group_quant_linear(x, qweight, scales, offsets, g_idx, group_size, bias)
