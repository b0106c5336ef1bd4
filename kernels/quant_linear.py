"""w8a16_linear: y = x @ (scale * W_q)^T + bias with 8-bit weights (Triton).

W_q is int8 (W8A16, symmetric) or float8 e4m3 (FP8 weight-only); x is 16- or 32-bit. Each
weight tile is upcast to x's dtype inside the kernel (int8 values |q| <= 127 and every e4m3
value are exact in fp16/bf16/fp32), multiplied on tensor cores with fp32 accumulation, and the
per-output-channel scale is applied once per output in the epilogue: sum_k x[m,k] q[n,k] times
scale[n] equals the product with the dequantized weight up to fp32 rounding. The torch twin
(kernels/twins.py w8a16_linear) dequantizes slices of rows instead; it is the oracle.

Shapes: x [M, K], weight [N, K] (any row stride, unit column stride), scale [N] fp32,
bias [N] or None, out [M, N] in x's dtype.
"""

import torch
import triton
import triton.language as tl

from kernels.quant_gemv import GEMV_ROWS, gemv_config, launch_gemv
from kernels.split_k import finish_split, launch_shape

WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, k_per_split,
                  stride_xm, stride_wn, stride_os, stride_om,
                  HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        a = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        # [BLOCK_K, BLOCK_N]: W^T's tile, upcast to x's dtype (exact for int8 and e4m3).
        # Masked lanes are zeroed after the upcast: `other` cannot be given as an fp8 value.
        mask_w = mask_k[:, None] & mask_n[None, :]
        w = tl.load(w_cols + ks[:, None], mask=mask_w)
        b = tl.where(mask_w, w.to(x_ptr.dtype.element_ty), 0.0).to(x_ptr.dtype.element_ty)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    scale = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
    acc = acc * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = (out_ptr + pid_k.to(tl.int64) * stride_os + offs_m.to(tl.int64)[:, None] * stride_om
           + offs_n[None, :])
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def launch_config(num_tokens: int, dtype: torch.dtype) -> dict:
    """One to GEMV_ROWS rows: the GEMV kernel (kernels/quant_gemv.py). More decode rows: the
    smallest M tile tl.dot takes, long K tiles and split-K (kernels/split_k.py), so the grid
    covers the device (the step is a weight stream). Prefill: square tiles. fp32 tiles of 64 x 64 spill on sm_90 (ieee dots hold more
    registers)."""
    fp32 = dtype == torch.float32
    if num_tokens <= GEMV_ROWS:
        return dict(gemv_config(0), GEMV=True)
    if num_tokens <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32 if fp32 else 128, num_warps=4,
                    num_stages=3)
    return dict(BLOCK_M=32 if fp32 else 64, BLOCK_N=64, BLOCK_K=32 if fp32 else 64,
                num_warps=4, num_stages=2)


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None, config: dict | None = None) -> torch.Tensor:
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], \
        f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K] and [N, K]"
    assert weight.dtype in WEIGHT_DTYPES, f"weight dtype {weight.dtype} is not int8 or e4m3"
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), x.dtype
    num_tokens, in_features = x.shape
    out_features = weight.shape[0]
    assert scale.dtype == torch.float32 and scale.shape == (out_features,), \
        f"scale must be fp32 [{out_features}], got {scale.dtype} {tuple(scale.shape)}"
    assert bias is None or bias.shape == (out_features,), "bias must be [N]"
    if x.stride(1) != 1:
        x = x.contiguous()
    assert weight.stride(1) == 1, "weight rows must be contiguous"
    if num_tokens == 0 or out_features == 0:
        return torch.empty((num_tokens, out_features), dtype=x.dtype, device=x.device)
    config = dict(config or launch_config(num_tokens, x.dtype))
    if config.pop("GEMV", False):
        return launch_gemv(x, weight, scale, None, bias, 0, 0, 0, config)
    grid, k_per_split, out = launch_shape(x, out_features, in_features, config)
    _w8a16_kernel[grid](
        x, weight, scale, bias if bias is not None else scale, out,
        num_tokens, out_features, in_features, k_per_split, x.stride(0), weight.stride(0),
        out.stride(0) if grid[2] > 1 else 0, out.stride(-2),
        HAS_BIAS=bias is not None and grid[2] == 1, IEEE=x.dtype == torch.float32, **config,
    )
    return finish_split(out, bias, x.dtype)  # [num_tokens, out_features]
