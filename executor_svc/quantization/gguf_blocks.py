"""GGUF's block-quantized rows -> `GroupedWeight` (quantization/grouped.py), in torch.

A GGUF matrix [N, K] of a block type is stored row by row, each row K / block_elems blocks of
block_bytes bytes (ggml's layout, what llama.cpp writes and the `gguf` package reads). The
types kept quantized here, and the GroupedWeight each one unpacks to (d, dmin: fp16 block
scales; sc, m: a sub-block's 6-bit scale and min; all products and sums fp32):

    Q8_0  34 B / 32:  d, 32 int8                q int8,       group 32, scale d
    Q4_0  18 B / 32:  d, 16 B nibbles           q uint8 0..15, group 32, scale d, offset -8 d
    Q4_1  20 B / 32:  d, m, 16 B nibbles        q uint8 0..15, group 32, scale d, offset m
    Q4_K 144 B / 256: d, dmin, 12 B of 6-bit (sc, m) for 8 sub-blocks of 32, 128 B nibbles
                                                q uint8 0..15, group 32, scale d*sc,
                                                offset -(dmin*m)
    Q6_K 210 B / 256: 128 B low nibbles, 64 B high 2-bit pairs, 16 int8 scales, d
                                                q int8 (6 bits - 32), group 16, scale d*sc

Every value is what ggml's dequantization computes, bit for bit: an fp16 scale times a small
integer is exact in fp32 (at most 11 + 6 + 6 significant bits), so `q * scale + offset` rounds
once, in the same sum the reference rounds (tests/executor/quantization/test_gguf_blocks.py checks this
against `gguf.quants.dequantize`).
"""

from __future__ import annotations

import torch

from executor_svc.quantization.grouped import GroupedWeight

# type -> (elements per block, bytes per block); the types `unpack_blocks` takes.
BLOCK_TYPES: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q4_K": (256, 144),
    "Q6_K": (256, 210),
}


def row_bytes(ggml_type: str, k: int) -> int:
    """Bytes of one row of `k` elements; ValueError unless `k` is whole blocks."""
    elems, size = BLOCK_TYPES[ggml_type]
    if k % elems:
        raise ValueError(f"{ggml_type} rows hold whole blocks of {elems} elements, got {k}")
    return k // elems * size


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (little-endian fp16) -> [...] fp32."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor, span: int) -> torch.Tensor:
    """[..., c * span] packed bytes -> [..., c * 2 * span] values 0..15: each run of `span`
    bytes gives its `span` low nibbles, then its `span` high nibbles (ggml's order)."""
    lead = qs.shape[:-1]
    runs = qs.reshape(*lead, -1, 1, span)
    both = torch.cat([runs & 0xF, runs >> 4], dim=-2)  # [..., c, 2, span]
    return both.reshape(*lead, -1)


def unpack_blocks(raw: torch.Tensor, ggml_type: str, k: int) -> GroupedWeight:
    """uint8 [N, row_bytes] rows of `ggml_type` blocks holding [N, k] -> GroupedWeight."""
    if ggml_type not in BLOCK_TYPES:
        raise ValueError(f"GGUF type {ggml_type!r} is not kept quantized (supported: "
                         f"{', '.join(BLOCK_TYPES)})")
    if raw.dtype != torch.uint8 or raw.dim() != 2:
        raise ValueError(f"raw GGUF blocks are uint8 [N, row_bytes], got {raw.dtype} "
                         f"{tuple(raw.shape)}")
    expect = row_bytes(ggml_type, k)
    if raw.shape[1] != expect:
        raise ValueError(f"{ggml_type} rows of {k} elements take {expect} bytes, got "
                         f"{raw.shape[1]}")
    elems, size = BLOCK_TYPES[ggml_type]
    n = raw.shape[0]
    blocks = raw.reshape(n, k // elems, size)  # [N, B, block_bytes]
    return _UNPACK[ggml_type](blocks, n, k)


def _q8_0(blocks: torch.Tensor, n: int, k: int) -> GroupedWeight:
    d = _f16(blocks[..., 0:2])  # [N, B]
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k)
    return GroupedWeight(q, d, None, 32)


def _q4_0(blocks: torch.Tensor, n: int, k: int) -> GroupedWeight:
    d = _f16(blocks[..., 0:2])
    q = _nibbles(blocks[..., 2:], 16).reshape(n, k)
    return GroupedWeight(q, d, d * -8.0, 32)


def _q4_1(blocks: torch.Tensor, n: int, k: int) -> GroupedWeight:
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    q = _nibbles(blocks[..., 4:], 16).reshape(n, k)
    return GroupedWeight(q, d, m, 32)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes -> (sc, m) [..., 8] 6-bit: sub-blocks 0-3 in the low 6 bits of bytes
    0-3 (sc) and 4-7 (m); sub-blocks 4-7 from the nibbles of bytes 8-11 plus the top 2 bits
    of bytes 0-3 (sc) and 4-7 (m)."""
    lo_sc, lo_m, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([lo_sc & 0x3F, (hi & 0xF) | ((lo_sc >> 2) & 0x30)], dim=-1)
    m = torch.cat([lo_m & 0x3F, (hi >> 4) | ((lo_m >> 2) & 0x30)], dim=-1)
    return sc, m


def _q4_k(blocks: torch.Tensor, n: int, k: int) -> GroupedWeight:
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [N, B]
    sc, m = _k_scale_min(blocks[..., 4:16])  # [N, B, 8]
    scales = (d[..., None] * sc.float()).reshape(n, -1)
    offsets = -(dmin[..., None] * m.float()).reshape(n, -1)
    q = _nibbles(blocks[..., 16:], 32).reshape(n, k)
    return GroupedWeight(q, scales, offsets, 32)


def _q6_k(blocks: torch.Tensor, n: int, k: int) -> GroupedWeight:
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    sc = blocks[..., 192:208].contiguous().view(torch.int8)  # [N, B, 16]
    d = _f16(blocks[..., 208:210])
    low = _nibbles(ql, 64)  # [N, B, 256]: per half of the block, 64 low then 64 high nibbles
    pairs = qh.reshape(*qh.shape[:-1], 2, 1, 32) >> torch.arange(
        0, 8, 2, dtype=torch.uint8, device=qh.device).reshape(4, 1)
    high = (pairs & 0x3).reshape(low.shape)  # per half: bits of 32-value runs 0, 1, 2, 3
    q = ((low | (high << 4)).view(torch.int8) - 32).reshape(n, k)
    scales = (d[..., None] * sc.float()).reshape(n, -1)
    return GroupedWeight(q, scales, None, 16)


_UNPACK = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k}
