"""Quantized weights in the fused CPU kernels' slabs (kernels/csrc/skinny_linear_quant.cpp).

    slabs = pack_grouped(q, scales, offsets, group_size)  # None: not built / not supported
    y = grouped_linear(x, slabs, bias)                    # x [M, K] -> [M, N], x's dtype

    f8 = pack_fp8(qweight)                                # [N, K] e4m3 -> slabs, or None
    y = fp8_linear(x, f8, scale, bias)

Grouped weights are executor_svc/quantization/grouped.py's `GroupedWeight` without g_idx:
W[n, k] = q[n, k] * scales[n, k // group_size] + offsets[n, k // group_size] (fp32, product
rounded then the offset added). The kernels compute exactly that weight and multiply by it in
fp32, so their result is bitwise the fp32 skinny kernel's on the dequantized matrix, and a row's
result does not depend on the other rows. Supported: K % group_size == 0, and for 4 bits an even
group_size (two codes a byte share a group); anything else (or no fused kernels) -> None, and
the caller keeps its own path.

Slabs, per block of 16 output features (zero past N): 4-bit codes [ceil(N/16), K/2, 16] uint8
(k = 2j in the low nibble of row j, 2j + 1 in the high), 8-bit [ceil(N/16), K, 16] int8, scales
and offsets [ceil(N/16), K / group_size, 16] fp16 when both hold only values fp16 represents
exactly (GGUF's blocks store them so: fewer bytes to stream, the same fp32 weight), else fp32;
fp8 [ceil(N/16), K, 16] float8_e4m3fn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu_ext

PACK_N = 16  # output features per slab block (skinny.h kPackN)


def _slabs(t: torch.Tensor) -> torch.Tensor:
    """[N, C] -> [ceil(N / 16), C, 16]: 16 rows side by side per block, zero past N."""
    n, c = t.shape
    blocks = -(-n // PACK_N)
    padded = t.new_zeros(blocks * PACK_N, c)
    padded[:n] = t
    return padded.view(blocks, PACK_N, c).transpose(1, 2).contiguous()


def _unslab(slabs: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of _slabs: [ceil(N / 16), C, 16] -> [N, C]."""
    return slabs.permute(0, 2, 1).reshape(-1, slabs.shape[1])[:n].contiguous()


@dataclass(frozen=True, eq=False)  # tensors: identity, not elementwise ==
class GroupedSlabs:
    """A grouped layer's matrix as the fused kernels read it (layout: module docstring)."""

    q: torch.Tensor  # [ceil(N/16), K/2, 16] uint8 (bits 4) or [ceil(N/16), K, 16] int8 (bits 8)
    scales: torch.Tensor  # [ceil(N/16), G, 16] fp16 (each value exact) or fp32
    offsets: torch.Tensor | None  # like scales (the same dtype), or None: zero
    out_features: int  # N
    in_features: int  # K
    bits: int  # 4 or 8
    group_size: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.q, self.scales, self.offsets) if t is not None)

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q [N, K], scales [N, G] fp32, offsets [N, G] fp32 or None), as given to
        pack_grouped."""
        n = self.out_features
        q = _unslab(self.q, n)
        if self.bits == 4:  # [N, K/2] bytes -> [N, K] codes
            q = torch.stack([q & 0xF, q >> 4], dim=2).reshape(n, self.in_features)
        offsets = _unslab(self.offsets, n).float() if self.offsets is not None else None
        return q, _unslab(self.scales, n).float(), offsets


def grouped_supported(in_features: int, bits: int, group_size: int) -> bool:
    """Whether the fused kernels take this shape (K a multiple of an even group for 4 bits)."""
    return (group_size > 0 and in_features > 0 and in_features % group_size == 0
            and (bits == 8 or group_size % 2 == 0))


def pack_grouped(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                 group_size: int) -> GroupedSlabs | None:
    """q [N, K] uint8 (4-bit codes 0..15) or int8, scales / offsets [N, K / group_size] fp32
    (offsets may be None) -> GroupedSlabs; None when the fused kernels are not built or the
    shape is not supported. Raises ValueError for operands that contradict each other."""
    if q.dtype not in (torch.uint8, torch.int8) or q.dim() != 2:
        raise ValueError(f"q must be [N, K] uint8 (4-bit) or int8 (8-bit), got {q.dtype} "
                         f"{tuple(q.shape)}")
    n, k = q.shape
    bits = 4 if q.dtype == torch.uint8 else 8
    if not grouped_supported(k, bits, group_size) or cpu_ext.load() is None or q.is_cuda:
        return None
    groups = k // group_size
    for name, t in (("scales", scales), ("offsets", offsets)):
        if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != (n, groups)):
            raise ValueError(f"{name} must be fp32 [{n}, {groups}], got {t.dtype} "
                             f"{tuple(t.shape)}")
    if bits == 4:
        if q.numel() and int(q.max()) > 15:
            raise ValueError("4-bit codes must lie in 0..15")
        codes = q[:, 0::2] | (q[:, 1::2] << 4)  # [N, K/2]: group_size is even, so K is
    else:
        codes = q
    if _fp16_exact(scales) and (offsets is None or _fp16_exact(offsets)):
        scales, offsets = scales.half(), offsets.half() if offsets is not None else None
    return GroupedSlabs(_slabs(codes), _slabs(scales),
                        _slabs(offsets) if offsets is not None else None, n, k, bits, group_size)


def _fp16_exact(t: torch.Tensor) -> bool:
    """Every value of fp32 `t` is an fp16 value (so fp16 storage widens back to the same bits)."""
    return bool(torch.equal(t.half().float(), t))


def grouped_linear(x: torch.Tensor, slabs: GroupedSlabs,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (fp32, bf16 or fp16) @ W^T + bias -> [M, N] in x's dtype: fp32 sums, the bias
    added last."""
    ops = cpu_ext.load()
    op = ops.skinny_linear_g4 if slabs.bits == 4 else ops.skinny_linear_g8
    return op(x, slabs.q, slabs.scales, slabs.offsets, bias, slabs.out_features,
              slabs.group_size)


def pack_fp8(qweight: torch.Tensor) -> torch.Tensor | None:
    """[N, K] float8_e4m3fn -> [ceil(N/16), K, 16] slabs; None without the fused kernels."""
    if qweight.dtype != torch.float8_e4m3fn or qweight.dim() != 2:
        raise ValueError(f"pack_fp8 takes [N, K] float8_e4m3fn, got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    if cpu_ext.load() is None or qweight.is_cuda:
        return None
    return _slabs(qweight.view(torch.uint8)).view(torch.float8_e4m3fn)


def unpack_fp8(slabs: torch.Tensor, out_features: int) -> torch.Tensor:
    """Inverse of pack_fp8: the [N, K] float8_e4m3fn matrix."""
    return _unslab(slabs.view(torch.uint8), out_features).view(torch.float8_e4m3fn)


def fp8_linear(x: torch.Tensor, slabs: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ (scale[:, None] * W)^T + bias -> [M, N] in x's dtype, W = the fp8 slabs'
    matrix, scale [N] fp32 applied to each feature's fp32 sum before the bias."""
    return cpu_ext.load().skinny_linear_f8(x, slabs, scale, bias, scale.numel())
