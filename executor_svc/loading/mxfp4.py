"""MXFP4 (OCP Microscaling, FP4 E2M1 elements with an E8M0 scale per 32) decoded to floats, as
gpt-oss's experts are shipped and Folio serves them: dequantized once at load into the model
dtype (models/gpt_oss.py `GptOssExperts`), never multiplied in FP4.

Storage (openai's gpt-oss checkpoints, what transformers 5.24's Mxfp4 integration reads): a
tensor W [..., R, C] becomes

    blocks uint8 [..., R, C / 32, 16]   two FP4 codes a byte, the low nibble first:
                                        element 2j of a block is byte j & 0xF, 2j + 1 is byte j >> 4
    scales uint8 [..., R, C / 32]       one E8M0 exponent a block: 2 ** (s - 127)

and W[..., r, 32 * g + k] = fp4(code k of block g of row r) * 2 ** (scales[..., r, g] - 127).
An FP4 E2M1 code is sign (bit 3), exponent (bits 2..1, bias 1) and one mantissa bit (bit 0):
0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. E8M0 255 is NaN.

Both tables are built from their bit fields, and each product is a power of two times a value
of at most two significant bits: exact in float32 and bfloat16 (which share float32's
exponent range) for every scale, so those are computed in directly; float16 is computed in
float32 and rounded once.
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 32  # elements that share one E8M0 scale
BLOCK_BYTES = BLOCK_SIZE // 2  # two FP4 codes a byte


def _fp4_e2m1_values() -> torch.Tensor:
    """The 16 FP4 E2M1 codes' values, float32 [16], from the encoding's bit fields."""
    values = []
    for code in range(16):
        sign = -1.0 if code & 0b1000 else 1.0
        exponent, mantissa = (code >> 1) & 0b11, code & 0b1
        if exponent == 0:  # subnormal: 0 or 0.5
            values.append(sign * mantissa * 0.5)
        else:
            values.append(sign * (1.0 + mantissa * 0.5) * 2.0 ** (exponent - 1))
    return torch.tensor(values, dtype=torch.float32)


def _e8m0_values() -> torch.Tensor:
    """2 ** (s - 127) for every E8M0 byte s, float32 [256], written as bit patterns so no
    library exp2 rounds: s in 1..254 is the float32 of biased exponent s, s = 0 the
    subnormal 2 ** -127, s = 255 NaN."""
    bits = torch.arange(256, dtype=torch.int32) << 23
    bits[0] = 1 << 22
    bits[255] = 0x7FC00000
    return bits.view(torch.float32)


FP4_VALUES = _fp4_e2m1_values()
E8M0_VALUES = _e8m0_values()
_BYTES = torch.arange(256)
# Every byte's two elements, [256, 2]: (low nibble's value, high nibble's value).
BYTE_VALUES = torch.stack((FP4_VALUES[_BYTES & 0x0F], FP4_VALUES[_BYTES >> 4]), dim=-1)
# Dtypes whose exponent range holds every product exactly (so they are computed in directly).
_EXACT_DTYPES = (torch.float32, torch.bfloat16)


def check_mxfp4_shapes(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """Internal invariant (the loader checked the checkpoint's shapes against the model's)."""
    assert blocks.dtype == scales.dtype == torch.uint8, (blocks.dtype, scales.dtype)
    assert blocks.shape[-1] == BLOCK_BYTES and blocks.shape[:-1] == scales.shape, (
        blocks.shape, scales.shape)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> `dtype` [..., G * 32] (module
    docstring), on the blocks' device: one table lookup a byte and one a scale. Temporaries
    are about the output's size (float32 for float16): callers decode one expert at a time."""
    check_mxfp4_shapes(blocks, scales)
    compute = dtype if dtype in _EXACT_DTYPES else torch.float32
    device = blocks.device
    values = torch.index_select(BYTE_VALUES.to(device, compute), 0,
                                blocks.reshape(-1).int())  # [numel, 2]
    values = values.view(*scales.shape, BLOCK_SIZE)  # [..., G, 32], the low nibble first
    factors = torch.index_select(E8M0_VALUES.to(device, compute), 0, scales.reshape(-1).int())
    values *= factors.view(*scales.shape, 1)  # exact: a power of two times <= 2 bits
    return values.flatten(-2).to(dtype)


def covering_blocks(start: int, size: int) -> tuple[int, int, int]:
    """Elements [start, start + size) of a blocked dimension -> (first block, number of
    blocks, offset of `start` in the first block): the whole blocks that hold the range, at
    most one partial block at each end (a tensor-parallel rank's slice of the intermediate
    dimension need not fall on block boundaries)."""
    first = start // BLOCK_SIZE
    end = -(-(start + size) // BLOCK_SIZE)
    return first, end - first, start - first * BLOCK_SIZE
