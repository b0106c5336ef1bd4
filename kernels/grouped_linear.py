"""group_quant_linear: y = x @ W^T + bias with group-quantized 4- or 8-bit weights (Triton).

W[n, k] = q[n, k] * scales[n, g(k)] + offsets[n, g(k)] (executor_svc/quantization/grouped.py:
GPTQ, AWQ and GGUF's block types all unpack to it). Each weight tile is dequantized in
registers, inside the matmul: the packed bytes are loaded, 4-bit values taken from their
nibble (even k low, odd k high), the tile's groups looked up (k // group_size, or g_idx[k] for
GPTQ's act order) to gather their scale and offset, the fp32 value cast to x's dtype and fed
to tl.dot with fp32 accumulation; no dequantized copy of W exists in memory. The torch twin
(kernels/twins.py group_quant_linear) dequantizes slices of rows in fp32 instead; it is the
oracle.

Shapes: x [M, K] (unit column stride), qweight uint8 [N, ceil(K / 2)] (bits 4) or int8 [N, K]
(bits 8), scales/offsets [N, G] fp32 (offsets may be None for 8-bit), g_idx [K] int32 or None,
bias [N] or None, out [M, N] in x's dtype.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _group_quant_kernel(x_ptr, w_ptr, scale_ptr, offset_ptr, gidx_ptr, bias_ptr, out_ptr,
                        M, N, K, G, group_size, stride_xm, stride_wn, stride_om,
                        BITS: tl.constexpr, HAS_OFFSETS: tl.constexpr, HAS_GIDX: tl.constexpr,
                        HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]
    # [1, BLOCK_N]: row n of scales/offsets (int32: the launcher checks N * G fits)
    group_cols = offs_n[None, :] * G
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
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
        where = group_cols + groups[:, None]
        w = q.to(tl.float32) * tl.load(scale_ptr + where, mask=mask_w, other=0.0)
        if HAS_OFFSETS:
            w += tl.load(offset_ptr + where, mask=mask_w, other=0.0)
        b = w.to(x_ptr.dtype.element_ty)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def launch_config(num_tokens: int, dtype: torch.dtype) -> dict:
    """Decode rows: the smallest M tile tl.dot takes and wide N tiles (a weight stream).
    Prefill: wider M tiles. fp32 keeps smaller tiles (ieee dots hold more registers)."""
    block_k = 32 if dtype == torch.float32 else 64
    if num_tokens <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, num_warps=4)
    return dict(BLOCK_M=32 if dtype == torch.float32 else 64, BLOCK_N=64, BLOCK_K=block_k,
                num_warps=4)


def group_quant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       offsets: torch.Tensor | None, g_idx: torch.Tensor | None,
                       group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
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
    out = torch.empty((num_tokens, out_features), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or out_features == 0:
        return out
    config = launch_config(num_tokens, x.dtype)
    grid = (triton.cdiv(num_tokens, config["BLOCK_M"]),
            triton.cdiv(out_features, config["BLOCK_N"]))
    _group_quant_kernel[grid](
        x, qweight, scales, offsets if offsets is not None else scales,
        g_idx if g_idx is not None else scales, bias if bias is not None else scales, out,
        num_tokens, out_features, in_features, num_groups, group_size,
        x.stride(0), qweight.stride(0), out.stride(0),
        BITS=bits, HAS_OFFSETS=offsets is not None, HAS_GIDX=g_idx is not None,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, **config,
    )
    return out  # [num_tokens, out_features]
