"""w8a16_linear: the Triton kernel (int8 and e4m3 weights) against the torch twin, and the twin
against a float64 reference of x @ dequant(W)^T + b."""

import pytest
import torch

from kernels import twins

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def quantized(out_features: int, in_features: int, weight_dtype: torch.dtype, seed: int = 0):
    """(weight [N, K] int8/e4m3, scale [N] fp32): a random matrix quantized per channel."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen)
    top = 127.0 if weight_dtype == torch.int8 else FP8_MAX
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / top
    q = w / scale[:, None]
    q = q.round().clamp(-127, 127).to(torch.int8) if weight_dtype == torch.int8 else q.to(
        weight_dtype)
    return q, scale


def reference(x, weight, scale, bias):
    """float64 x @ (weight * scale)^T + bias."""
    w = weight.double() * scale.double()[:, None]
    out = x.double() @ w.t()
    return out if bias is None else out + bias.double()


WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)
# (num_tokens, out_features, in_features): decode rows, prefill rows, odd sizes that cut every
# tile (M, N and K not multiples of the blocks), K below one K block, one output channel.
SHAPES = [(1, 64, 64), (1, 97, 131), (3, 40, 200), (17, 33, 70), (70, 130, 96), (5, 1, 9)]


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_twin_against_float64(weight_dtype, shape, with_bias, monkeypatch):
    num_tokens, n, k = shape
    # Slices of 7 rows' worth of elements: several slices per matrix, the last one short.
    monkeypatch.setattr(twins, "DEQUANT_CHUNK_ELEMS", 7 * k)
    weight, scale = quantized(n, k, weight_dtype)
    x = torch.randn(num_tokens, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n) if with_bias else None
    got = twins.w8a16_linear(x, weight, scale, bias)
    assert got.dtype == torch.float32 and got.shape == (num_tokens, n)
    torch.testing.assert_close(got.double(), reference(x, weight, scale, bias),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_against_twin(triton_ops, device, weight_dtype, dtype, shape):
    num_tokens, n, k = shape
    weight, scale = quantized(n, k, weight_dtype, seed=2)
    gen = torch.Generator().manual_seed(3)
    # x as a column slice of a wider buffer: row stride != in_features.
    x = torch.randn(num_tokens, k + 5, generator=gen)[:, :k].to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if n % 2 else None
    expected = twins.w8a16_linear(x, weight, scale, bias)
    got = triton_ops.w8a16_linear(x.to(device), weight.to(device), scale.to(device),
                                  None if bias is None else bias.to(device)).cpu()
    assert got.dtype == dtype and got.shape == (num_tokens, n)
    # fp32: both accumulate in fp32 (orders differ); fp16: the output's own rounding.
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("split_k", [1, 3, None])
@pytest.mark.parametrize("gemv", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_split_k(triton_ops, device, split_k, gemv, dtype):
    """Forced and heuristic K splits (fp32 partial sums added after the kernel, then bias), in
    the tensor-core kernel and the GEMV one (kernels/quant_gemv.py), on e4m3 and int8."""
    n, k = 45, 300
    weight, scale = quantized(n, k, torch.float8_e4m3fn if gemv else torch.int8, seed=6)
    gen = torch.Generator().manual_seed(7)
    bias = torch.randn(n, generator=gen).to(dtype)
    config = dict(BLOCK_N=16, BLOCK_K=64, GEMV=True) if gemv else dict(BLOCK_M=16, BLOCK_N=32,
                                                                         BLOCK_K=32)
    if split_k:
        config["SPLIT_K"] = split_k
    for rows in (1, 17):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        expected = twins.w8a16_linear(x, weight, scale, bias)
        got = triton_ops.w8a16_linear(x.to(device), weight.to(device), scale.to(device),
                                      bias.to(device), config=config).cpu()
        tol = 2e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol * 10)


def test_triton_refuses_bad_operands(triton_ops):
    weight, scale = quantized(8, 16, torch.int8)
    x = torch.randn(2, 16)
    with pytest.raises(AssertionError, match="weight dtype"):
        triton_ops.w8a16_linear(x, weight.float(), scale, None)
    with pytest.raises(AssertionError, match="scale must be fp32"):
        triton_ops.w8a16_linear(x, weight, scale[:4], None)
    with pytest.raises(AssertionError, match="must be \\[M, K\\]"):
        triton_ops.w8a16_linear(x[:, :8], weight, scale, None)
