"""The MXFP4 decode (executor_svc/loading/mxfp4.py) against a float64 reference written from
the OCP Microscaling spec's tables, element by element: every byte as codes, every E8M0
scale, the low nibble first, leading dimensions, each model dtype; and the covering blocks of
a tensor-parallel range against a brute-force count."""

from __future__ import annotations

import math

import pytest
import torch

from executor_svc.loading.mxfp4 import covering_blocks, dequantize_mxfp4

# OCP MX v1.0, FP4 E2M1: the magnitudes of codes 0..7; bit 3 is the sign.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def reference(blocks: torch.Tensor, scales: torch.Tensor) -> list[float]:
    """Flat float64 values, row-major over [..., G * 32], one element at a time."""
    out = []
    flat_blocks = blocks.reshape(-1, 16).tolist()
    for row, scale in zip(flat_blocks, scales.reshape(-1).tolist(), strict=True):
        factor = math.nan if scale == 255 else 2.0 ** (scale - 127)
        for byte in row:
            for code in (byte & 0xF, byte >> 4):  # element 2j, then 2j + 1
                sign = -1.0 if code & 0x8 else 1.0
                out.append(sign * E2M1_MAGNITUDES[code & 0x7] * factor)
    return out


def _check(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
    got = dequantize_mxfp4(blocks, scales, dtype)
    assert got.dtype == dtype and got.shape == (*scales.shape[:-1], scales.shape[-1] * 32)
    # The exact value rounded once to `dtype` (float64 -> float32 is exact here but past the
    # range, where both give inf).
    expected = torch.tensor(reference(blocks, scales), dtype=torch.float64).to(dtype)
    assert torch.equal(got.reshape(-1).isnan(), expected.isnan())
    keep = ~expected.isnan()
    assert torch.equal(got.reshape(-1)[keep], expected[keep])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_byte_under_every_scale(dtype):
    """16 rows of all 256 bytes (8 blocks a row), the rows' blocks under all 128 x 2 scales."""
    blocks = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(1, 16, 16)
    blocks = blocks.expand(32, 16, 16).contiguous()  # [rows 32, blocks 16, 16 bytes]
    scales = torch.arange(512, dtype=torch.int32).reshape(32, 16) % 256
    _check(blocks, scales.to(torch.uint8), dtype)


def test_low_nibble_first():
    # Byte 0x71: element 0 is code 1 (0.5), element 1 code 7 (6.0); scale 2 ** 0.
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x71
    blocks[0, 15] = 0x9A  # elements 30, 31: code 0xA (-1.0), code 0x9 (-0.5)
    got = dequantize_mxfp4(blocks, torch.tensor([127], dtype=torch.uint8), torch.float32)
    assert got[:2].tolist() == [0.5, 6.0] and got[30:].tolist() == [-1.0, -0.5]
    assert not got[2:30].any()


def test_leading_dimensions_random():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 5, 4), generator=gen, dtype=torch.uint8)
    _check(blocks, scales, torch.float32)
    # Each expert's slice decodes to the same values as the whole (GptOssExperts decodes
    # expert by expert).
    whole = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(dequantize_mxfp4(blocks[1], scales[1], torch.float32), whole[1])


@pytest.mark.parametrize("size, tp", [(2880, 4), (2880, 8), (2880, 2), (96, 2), (64, 2),
                                      (128, 4), (160, 5)])
def test_covering_blocks(size, tp):
    """Every rank's blocks are exactly those holding one of its elements, and the offset
    lands on its first element."""
    local = size // tp
    for rank in range(tp):
        start = rank * local
        first, count, offset = covering_blocks(start, local)
        assert list(range(first, first + count)) == sorted({i // 32 for i in
                                                            range(start, start + local)})
        assert first * 32 + offset == start and 0 <= offset < 32
