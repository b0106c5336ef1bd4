"""Group-quantized weights (4- or 8-bit integers, one scale and offset per group of inputs):
the common form GPTQ, AWQ and GGUF's block types are unpacked into at load.

A `GroupedWeight` holds a layer's matrix [N, K] as integers `q` with, for every output row n
and every group g of input columns, a scale and an offset:

    W[n, k] = q[n, k] * scales[n, g(k)] + offsets[n, g(k)]      (fp32: product, then sum)

with g(k) = k // group_size, or `g_idx[k]` where a GPTQ checkpoint stores its act-order
grouping. `q` is uint8 in 0..15 when bits == 4 (unsigned; an integer zero point z becomes
the offset -z * scale, exact in fp32 for fp16 scales) and int8 when bits == 8 (signed,
offsets may be None). That definition is the oracle: `dequantize` computes it, and every
kernel (kernels/grouped_linear.py and its twin, the CPU's fused slabs) multiplies by it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels


@dataclass
class GroupedWeight:
    q: torch.Tensor  # [N, K] uint8 (bits 4: 0..15) or int8 (bits 8)
    scales: torch.Tensor  # [N, G] fp32, G = ceil(K / group_size) (or g_idx.max() + 1)
    offsets: torch.Tensor | None  # [N, G] fp32, or None (bits 8 only): zero
    group_size: int
    g_idx: torch.Tensor | None = None  # [K] int32 group of each input column; None: k // gs

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.q.dtype not in (torch.uint8, torch.int8):
            raise ValueError(f"grouped weights are uint8 (4-bit) or int8 (8-bit), got {self.q.dtype}")
        if self.q.dtype == torch.uint8 and self.offsets is None:
            raise ValueError("4-bit grouped weights are unsigned and need offsets")
        if self.group_size < 1:
            raise ValueError(f"group_size must be positive, got {self.group_size}")
        groups = self.num_groups
        for name in ("scales", "offsets"):
            t = getattr(self, name)
            if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != (n, groups)):
                raise ValueError(f"{name} must be fp32 [{n}, {groups}], got {t.dtype} "
                                 f"{tuple(t.shape)}")
        if self.g_idx is not None and tuple(self.g_idx.shape) != (k,):
            raise ValueError(f"g_idx must be [{k}], got {tuple(self.g_idx.shape)}")

    @property
    def bits(self) -> int:
        return 4 if self.q.dtype == torch.uint8 else 8

    @property
    def num_groups(self) -> int:
        if self.g_idx is not None:
            return self.scales.shape[1]
        return -(-self.q.shape[1] // self.group_size)

    def groups(self) -> torch.Tensor:
        """[K] int64: the group of every input column."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.q.shape[1], device=self.q.device) // self.group_size

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """fp32 [N, K] (or those `rows`) by the definition above."""
        g = self.groups()
        w = self.q[rows].float() * self.scales[rows][:, g]
        if self.offsets is not None:
            w = w + self.offsets[rows][:, g]
        return w


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values 0..15 -> uint8 [N, ceil(K / 2)]: column 2j in the low nibble of
    byte j, column 2j + 1 in its high nibble (zero past K)."""
    n, k = q.shape
    if k % 2:
        q = torch.cat([q, q.new_zeros(n, 1)], dim=1)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of pack_int4: uint8 [N, ceil(K / 2)] -> uint8 [N, K]."""
    both = torch.stack([packed & 0xF, packed >> 4], dim=2)  # [N, ceil(K/2), 2]
    return both.reshape(packed.shape[0], -1)[:, :k].contiguous()


def contiguous_groups(gw: GroupedWeight) -> tuple[GroupedWeight, torch.Tensor | None]:
    """(the same matrix with consecutive groups, the column permutation the input needs) where
    that exists, else (gw, None) unchanged.

    g_idx first names only the groups it uses (a row-parallel rank's slice of an act-order
    layer uses some of the checkpoint's groups, the scales of the others are dropped). If the
    columns, sorted by group, then fall in groups of exactly `group_size` (GPTQ's act order
    always does), W[:, perm] has groups k // group_size and x @ W^T = x[:, perm] @ W[:, perm]^T;
    a trivial g_idx (k // group_size already) gives no permutation at all."""
    if gw.g_idx is None:
        return gw, None
    used, g_idx = torch.unique(gw.g_idx.long(), return_inverse=True)
    scales = gw.scales[:, used].contiguous()
    offsets = gw.offsets[:, used].contiguous() if gw.offsets is not None else None
    k = gw.q.shape[1]
    order = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[order], torch.arange(k, device=g_idx.device) // gw.group_size):
        return GroupedWeight(gw.q, scales, offsets, gw.group_size, g_idx.to(torch.int32)), None
    if torch.equal(order, torch.arange(k, device=order.device)):
        return GroupedWeight(gw.q, scales, offsets, gw.group_size), None
    return GroupedWeight(gw.q[:, order].contiguous(), scales, offsets, gw.group_size), order


class GroupedWeightOnly:
    """The linear method of every group-quantized scheme. A subclass says how to read a
    layer's checkpoint tensors into a `GroupedWeight` (`grouped_weight`, which also releases
    them); this class keeps that form and multiplies by it.

    Invariant after ``process_weights(layer)``: ``layer.qweight`` (uint8 nibbles [N, ceil(K/2)]
    or int8 [N, K]), ``layer.qscales``/``layer.qoffsets`` [N, G] fp32 (offsets None allowed
    for 8-bit), ``layer.g_idx`` ([K] int32 or None), ``layer.group_size`` and
    ``layer.input_perm`` (None, or the column order the input is taken in) hold the matrix
    `grouped_weight` returned: ``grouped_of(layer)`` rebuilds it. `apply` runs
    ``kernels.group_quant_linear`` (Triton on CUDA, the twin on the CPU)."""

    quantized = True  # use_linear_method leaves a layer with this method alone

    def grouped_weight(self, layer) -> GroupedWeight:
        raise NotImplementedError

    def holds(self, layer) -> bool:
        """Whether the checkpoint stores this layer in the scheme's form."""
        raise NotImplementedError

    def process_weights(self, layer) -> None:
        gw, perm = contiguous_groups(self.grouped_weight(layer))
        layer.input_perm = perm
        layer.qweight = pack_int4(gw.q) if gw.bits == 4 else gw.q
        layer.qscales, layer.qoffsets = gw.scales, gw.offsets
        layer.g_idx, layer.group_size = gw.g_idx, gw.group_size
        layer.quant_in_features = gw.q.shape[1]

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [num_tokens, in_features]
        if layer.input_perm is not None:
            rows = rows.index_select(1, layer.input_perm)
        out = kernels.group_quant_linear(rows, layer.qweight, layer.qscales, layer.qoffsets,
                                         layer.g_idx, layer.group_size, bias)
        return out.view(*x.shape[:-1], out.shape[-1])


def grouped_of(layer) -> tuple[GroupedWeight, torch.Tensor | None]:
    """(the layer's matrix as it holds it, its input permutation): W[:, perm] is
    ``grouped_of(layer)[0].dequantize()`` (tests and tools)."""
    k = layer.quant_in_features
    q = unpack_int4(layer.qweight, k) if layer.qweight.dtype == torch.uint8 else layer.qweight
    return GroupedWeight(q, layer.qscales, layer.qoffsets, layer.group_size,
                         layer.g_idx), layer.input_perm
