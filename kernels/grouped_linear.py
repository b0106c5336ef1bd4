"""group_quant_linear: y = x @ W^T + bias with group-quantized 4- or 8-bit weights (Triton).

W[n, k] = q[n, k] * scales[n, g(k)] + offsets[n, g(k)] (executor_svc/quantization/grouped.py:
GPTQ, AWQ and GGUF's block types all unpack to it). No dequantized copy of W exists in memory.
Two ways through a K tile, chosen by the launcher:
- whole-group tiles (no g_idx and group_size a multiple of BLOCK_K: the tile lies in one
  group): the integer codes, exact in x's dtype, go straight into tl.dot, and the group's
  scale and offset are applied to the tile's fp32 partial product,
  sum_k x q s + o sum_k x = s (x . q) + o (sum x); 4-bit bytes are loaded once and their low
  and high nibbles (even and odd k) multiplied by x's even and odd columns;
- any other grouping (g_idx from GPTQ's act order, groups that split a tile): each code is
  dequantized in fp32 with its gathered scale and offset, cast to x's dtype, then tl.dot.
Few rows (decode) split K across programs (split-K) so the grid covers the device; the
splits' fp32 partial sums are added in a fixed order (deterministic), then bias and cast.
The torch twin (kernels/twins.py group_quant_linear) dequantizes slices of rows in fp32; it is
the oracle.

Shapes: x [M, K] (unit column stride), qweight uint8 [N, ceil(K / 2)] (bits 4) or int8 [N, K]
(bits 8), scales/offsets [N, G] fp32 (offsets may be None for 8-bit), g_idx [K] int32 or None,
bias [N] or None, out [M, N] in x's dtype.
"""

import torch
import triton
import triton.language as tl

from kernels.quant_gemv import GEMV_ROWS, gemv_config, launch_gemv
from kernels.split_k import finish_split, launch_shape


@triton.jit
def _group_quant_kernel(x_ptr, w_ptr, scale_ptr, offset_ptr, gidx_ptr, bias_ptr, out_ptr,
                        M, N, K, G, group_size, k_per_split, stride_xm, stride_wn,
                        stride_os, stride_om,
                        BITS: tl.constexpr, HAS_OFFSETS: tl.constexpr, HAS_GIDX: tl.constexpr,
                        TILE_GROUPS: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]
    group_rows = offs_n * G  # row n of scales/offsets (int32: the launcher checks N * G fits)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        if TILE_GROUPS:
            where = group_rows + k0 // group_size  # [BLOCK_N]: the tile's one group
            scale = tl.load(scale_ptr + where, mask=mask_n, other=0.0)
            if BITS == 4:
                half = tl.arange(0, BLOCK_K // 2)
                k_even = k0 + 2 * half
                packed = tl.load(w_cols + (k0 // 2 + half)[:, None],
                                 mask=(k_even < K)[:, None] & mask_n[None, :], other=0)
                a_even = tl.load(x_rows + k_even[None, :],
                                 mask=mask_m[:, None] & (k_even < K)[None, :], other=0.0)
                a_odd = tl.load(x_rows + (k_even + 1)[None, :],
                                mask=mask_m[:, None] & (k_even + 1 < K)[None, :], other=0.0)
                lo = (packed & 0xF).to(dtype)
                hi = (packed >> 4).to(dtype)
                if IEEE:
                    part = tl.dot(a_even, lo, input_precision="ieee")
                    part = tl.dot(a_odd, hi, part, input_precision="ieee")
                else:
                    part = tl.dot(a_odd, hi, tl.dot(a_even, lo))
                if HAS_OFFSETS:
                    a_sum = tl.sum(a_even.to(tl.float32), 1) + tl.sum(a_odd.to(tl.float32), 1)
            else:
                ks = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & (ks < K)[None, :],
                            other=0.0)
                q = tl.load(w_cols + ks[:, None], mask=(ks < K)[:, None] & mask_n[None, :],
                            other=0)
                if IEEE:
                    part = tl.dot(a, q.to(dtype), input_precision="ieee")
                else:
                    part = tl.dot(a, q.to(dtype))
                if HAS_OFFSETS:
                    a_sum = tl.sum(a.to(tl.float32), 1)
            acc += part * scale[None, :]
            if HAS_OFFSETS:
                offset = tl.load(offset_ptr + where, mask=mask_n, other=0.0)
                acc += a_sum[:, None] * offset[None, :]
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            mask_k = ks < K
            a = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            mask_w = mask_k[:, None] & mask_n[None, :]  # [BLOCK_K, BLOCK_N]: W^T's tile
            if BITS == 4:
                packed = tl.load(w_cols + (ks // 2)[:, None], mask=mask_w, other=0)
                q = (packed >> ((ks % 2) * 4).to(tl.uint8)[:, None]) & 0xF
            else:
                q = tl.load(w_cols + ks[:, None], mask=mask_w, other=0)
            if HAS_GIDX:
                groups = tl.load(gidx_ptr + ks, mask=mask_k, other=0)
            else:
                groups = ks // group_size
            where = group_rows[None, :] + groups[:, None]
            w = q.to(tl.float32) * tl.load(scale_ptr + where, mask=mask_w, other=0.0)
            if HAS_OFFSETS:
                w += tl.load(offset_ptr + where, mask=mask_w, other=0.0)
            if IEEE:
                acc = tl.dot(a, w.to(dtype), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w.to(dtype), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = (out_ptr + pid_k.to(tl.int64) * stride_os + offs_m.to(tl.int64)[:, None] * stride_om
           + offs_n[None, :])
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def tile_k(group_size: int, bits: int, g_idx, limit: int) -> int:
    """The K tile for whole-group tiles (the largest power of two <= limit dividing
    group_size, at least 16 codes per tl.dot operand), or 0 where tiles must gather."""
    if g_idx is not None:
        return 0
    smallest = 32 if bits == 4 else 16
    block_k = limit
    while block_k >= smallest:
        if group_size % block_k == 0:
            return block_k
        block_k //= 2
    return 0


def launch_config(num_tokens: int, dtype: torch.dtype, bits: int, group_size: int,
                  g_idx) -> dict:
    """One to GEMV_ROWS rows with whole-group K tiles: the GEMV kernel (kernels/quant_gemv.py).
    Other decode rows: the smallest M tile tl.dot takes, K tiles of whole groups where they fit,
    split-K decided by the launcher. Prefill: wider M tiles. fp32 keeps smaller tiles (ieee
    dots hold more registers)."""
    fp32 = dtype == torch.float32
    gemv = gemv_config(bits, group_size) if g_idx is None and num_tokens <= GEMV_ROWS else None
    if gemv is not None:
        return dict(gemv, GEMV=True)
    decode = num_tokens <= 16
    block_k = tile_k(group_size, bits, g_idx, 32 if fp32 else 128 if decode else 64)
    config = dict(BLOCK_M=16 if decode else 32 if fp32 else 64, BLOCK_N=64,
                  BLOCK_K=block_k or (32 if fp32 else 64), TILE_GROUPS=block_k > 0,
                  num_warps=4, num_stages=3 if decode else 2)
    return config


def group_quant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       offsets: torch.Tensor | None, g_idx: torch.Tensor | None,
                       group_size: int, bias: torch.Tensor | None,
                       config: dict | None = None) -> torch.Tensor:
    assert x.dim() == 2 and qweight.dim() == 2, "x and qweight must be 2-D"
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), x.dtype
    num_tokens, in_features = x.shape
    out_features = qweight.shape[0]
    bits = 4 if qweight.dtype == torch.uint8 else 8
    assert qweight.dtype in (torch.uint8, torch.int8), f"qweight dtype {qweight.dtype}"
    assert qweight.shape[1] == (-(-in_features // 2) if bits == 4 else in_features), \
        f"qweight {tuple(qweight.shape)} does not hold {in_features} {bits}-bit columns"
    num_groups = scales.shape[1]
    assert scales.dtype == torch.float32 and scales.shape == (out_features, num_groups)
    assert offsets is None or (offsets.dtype == torch.float32 and offsets.shape == scales.shape)
    assert bits == 8 or offsets is not None, "4-bit weights are unsigned: offsets needed"
    assert g_idx is None or g_idx.shape == (in_features,), "g_idx must be [K]"
    assert bias is None or bias.shape == (out_features,), "bias must be [N]"
    assert scales.numel() < 2**31, "scales index in int32"
    if x.stride(1) != 1:
        x = x.contiguous()
    assert qweight.stride(1) == 1 and scales.is_contiguous()
    assert offsets is None or offsets.is_contiguous()
    if num_tokens == 0 or out_features == 0:
        return torch.empty((num_tokens, out_features), dtype=x.dtype, device=x.device)
    config = dict(config or launch_config(num_tokens, x.dtype, bits, group_size, g_idx))
    if config.pop("GEMV", False):  # whole-group K tiles, on the CUDA cores
        assert g_idx is None and group_size % config["BLOCK_K"] == 0, config
        return launch_gemv(x, qweight, scales, offsets, bias, bits, group_size, num_groups,
                           config)
    if config.get("TILE_GROUPS"):  # a K tile lies in one group: k0 // group_size names it
        assert g_idx is None and group_size % config["BLOCK_K"] == 0, config
        assert config["BLOCK_K"] >= (32 if bits == 4 else 16), config
    grid, k_per_split, out = launch_shape(x, out_features, in_features, config)
    _group_quant_kernel[grid](
        x, qweight, scales, offsets if offsets is not None else scales,
        g_idx if g_idx is not None else scales, bias if bias is not None else scales, out,
        num_tokens, out_features, in_features, num_groups, group_size, k_per_split,
        x.stride(0), qweight.stride(0), out.stride(0) if grid[2] > 1 else 0, out.stride(-2),
        BITS=bits, HAS_OFFSETS=offsets is not None, HAS_GIDX=g_idx is not None,
        HAS_BIAS=bias is not None and grid[2] == 1, IEEE=x.dtype == torch.float32, **config,
    )
    return finish_split(out, bias, x.dtype)  # [num_tokens, out_features]
