"""Weight-only quantized GEMV: the decode rows of w8a16_linear and group_quant_linear (Triton).

With one to a few rows, tensor-core tiles waste most of their M side and the step is a pure
weight stream, so these kernels multiply on the CUDA cores instead: one program takes one row of
x, BLOCK_N output channels and one K split, loads [BLOCK_N, BLOCK_K] weight tiles along their
contiguous K (wide vector loads), multiplies by x's slice in fp32 and reduces over K. Rows of
the same weight tile are adjacent program ids (grid axis 0), so they run together and share the
tile through L2. Split-K and its fixed-order reduction: kernels/split_k.py.

KIND 0: 8-bit per channel (int8 or e4m3; scale [N] applied once at the end). KIND 4 / 8: 4- or
8-bit codes with per-group scales and offsets [N, G] (executor_svc/quantization/grouped.py),
K tiles of whole groups only (the launcher checks group_size % BLOCK_K == 0, no g_idx): the
group's scale multiplies the tile's partial sum and its offset the sum of x over the tile;
4-bit bytes hold k even in the low nibble, odd in the high one.
"""

import triton
import triton.language as tl

GEMV_ROWS = 4  # decode rows at most that take these kernels


@triton.jit
def _quant_gemv_kernel(x_ptr, w_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr, N, K, G,
                       group_size, k_per_split, stride_xm, stride_wn, stride_os, stride_om,
                       KIND: tl.constexpr, HAS_OFFSETS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        if KIND == 4:
            half = tl.arange(0, BLOCK_K // 2)
            k_even = k0 + 2 * half
            packed = tl.load(w_rows + (k0 // 2 + half)[None, :],
                             mask=mask_n[:, None] & (k_even < K)[None, :], other=0)
            x_even = tl.load(x_row + k_even, mask=k_even < K, other=0.0).to(tl.float32)
            x_odd = tl.load(x_row + k_even + 1, mask=k_even + 1 < K, other=0.0).to(tl.float32)
            part = tl.sum((packed & 0xF).to(tl.float32) * x_even[None, :]
                          + (packed >> 4).to(tl.float32) * x_odd[None, :], axis=1)
            x_sum = tl.sum(x_even, 0) + tl.sum(x_odd, 0)
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            mask_w = mask_n[:, None] & (ks < K)[None, :]
            # Masked lanes zeroed after the upcast: `other` cannot be given as an fp8 value.
            w = tl.where(mask_w, tl.load(w_rows + ks[None, :], mask=mask_w).to(tl.float32), 0.0)
            xs = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            part = tl.sum(w * xs[None, :], axis=1)
            x_sum = tl.sum(xs, 0)
        if KIND == 0:
            acc += part
        else:
            where = offs_n * G + k0 // group_size  # the tile's one group, per channel
            acc += part * tl.load(scale_ptr + where, mask=mask_n, other=0.0)
            if HAS_OFFSETS:
                acc += x_sum * tl.load(offset_ptr + where, mask=mask_n, other=0.0)
    if KIND == 0:
        acc *= tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    out = out_ptr + pid_k.to(tl.int64) * stride_os + m.to(tl.int64) * stride_om + offs_n
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def gemv_config(kind: int, group_size: int = 0) -> dict | None:
    """Tile sizes for a kind, or None where no whole-group K tile fits (the launcher then takes
    the tensor-core kernel)."""
    if kind == 0:
        return dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3)
    for block_k in (256, 128, 64, 32):
        if group_size % block_k == 0:
            return dict(BLOCK_N=64 if kind == 4 else 32, BLOCK_K=block_k, num_warps=4,
                        num_stages=3)
    return None


def launch_gemv(x, weight, scale, offset, bias, kind: int, group_size: int, num_groups: int,
                config: dict):
    """x [M, K] (M rows, unit column stride) against an [N, *] quantized weight; returns the
    output (split-K summed, bias added, in x's dtype)."""
    from kernels.split_k import finish_split, launch_shape

    num_tokens, in_features = x.shape
    out_features = weight.shape[0]
    config = dict(config, BLOCK_M=1)
    grid, k_per_split, out = launch_shape(x, out_features, in_features, config)
    config.pop("BLOCK_M")
    _quant_gemv_kernel[grid](
        x, weight, scale, offset if offset is not None else scale,
        bias if bias is not None else scale, out, out_features, in_features, num_groups,
        group_size, k_per_split, x.stride(0), weight.stride(0),
        out.stride(0) if grid[2] > 1 else 0, out.stride(-2),
        KIND=kind, HAS_OFFSETS=offset is not None, HAS_BIAS=bias is not None and grid[2] == 1,
        **config,
    )
    return finish_split(out, bias, x.dtype)
