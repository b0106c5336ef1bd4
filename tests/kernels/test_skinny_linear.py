"""The skinny linear kernel (kernels/csrc/skinny_linear.cpp) against float64 products and
F.linear (its twin), and PackedCpuLinear's choice between it and oneDNN.

Each output element is one thread's in-order fp32 sum over k, so a row's result does not
depend on the other rows of the batch nor on the thread count: checked bitwise.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.models.linear import (
    SKINNY_MAX_ROWS,
    Linear,
    PackedCpuLinear,
    pack_skinny_weight,
    use_linear_method,
)
from kernels import cpu, cpu_ext

ops = cpu_ext.load()
pytestmark = pytest.mark.skipif(ops is None, reason="the fused CPU kernels did not build here")
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # of max |y|


def _check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    got = ops.skinny_linear(x, pack_skinny_weight(w), bias, w.shape[0])
    expected = x.double() @ w.double().t() + (bias.double() if bias is not None else 0)
    assert got.dtype == x.dtype and got.shape == expected.shape
    scale = max(expected.abs().max().item(), 1e-30) if expected.numel() else 1.0
    err = (got.double() - expected).abs().max().item() if expected.numel() else 0.0
    assert err <= TOLERANCE[x.dtype] * scale, (err, scale)
    twin = F.linear(x.float(), w.float(), bias.float() if bias is not None else None)
    # Another summation order than the twin's: equal within the dtype's rounding of the result.
    torch.testing.assert_close(got.float(), twin.to(x.dtype).float(), rtol=TOLERANCE[x.dtype],
                               atol=TOLERANCE[x.dtype] * scale)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 17, 64])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (100, 33), (7, 5), (65, 1)])
def test_matches_float64_and_the_twin(dtype, rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    _check(x, w, bias)
    _check(x, w, None)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 20), out_features=st.integers(1, 200), in_features=st.integers(1, 80),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), bias=st.booleans())
def test_random_shapes(rows, out_features, in_features, dtype, bias):
    gen = torch.Generator().manual_seed(rows + 31 * out_features + 977 * in_features)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    _check(x, w, b)


def test_strided_rows_are_read_in_place():
    w = torch.randn(48, 40)
    x = torch.randn(3, 64)[:, 8:48]  # row stride 64
    _check(x, w, None)


def test_rows_do_not_depend_on_the_batch_nor_the_threads():
    w, x = torch.randn(300, 96), torch.randn(11, 96)
    packed = pack_skinny_weight(w)
    together = ops.skinny_linear(x, packed, None, 300)
    for i in range(11):
        assert torch.equal(ops.skinny_linear(x[i:i + 1], packed, None, 300)[0], together[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = ops.skinny_linear(x, packed, None, 300)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)


@pytest.mark.parametrize("bad", ["unpacked", "in_features", "out_features", "dtype", "bias"])
def test_refuses_mismatched_operands(bad):
    w, x, bias = torch.randn(40, 24), torch.randn(2, 24), torch.randn(40)
    packed, out_features = pack_skinny_weight(w), 40
    if bad == "unpacked":
        packed = w
    elif bad == "in_features":
        x = torch.randn(2, 25)
    elif bad == "out_features":
        out_features = 70
    elif bad == "dtype":
        x = x.bfloat16()
    else:
        bias = torch.randn(41)
    with pytest.raises(RuntimeError, match="skinny_linear"):
        ops.skinny_linear(x, packed, bias, out_features)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not cpu.has_native_bf16(), reason="bf16 is packed only with native bf16 matmuls; without, "
    "UpcastCpuLinear (tests/executor/test_cpu_backend.py)"))])
def test_packed_linear_switches_at_the_row_limit(dtype):
    layer = Linear(96, 200, bias=True, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(200, 96))
        layer.bias.copy_(torch.randn(200))
    plain_w, plain_b = layer.weight.detach().clone(), layer.bias.detach().clone()
    use_linear_method(layer, PackedCpuLinear())
    assert layer.weight.numel() == 0 and layer.skinny_weight.shape == (13, 96, 16)
    limit = SKINNY_MAX_ROWS[dtype]
    for rows in (1, limit, limit + 1, 3 * limit):
        x = torch.randn(rows, 96).to(dtype)
        expected = F.linear(x.float(), plain_w.float(), plain_b.float()).to(dtype)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(layer(x), expected, rtol=tol, atol=tol)


# ---- int8 weights (weight-only int8, executor_svc/quantization/methods.py) -----------------

def _q8(out_features: int, in_features: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen)
    scale = w.abs().amax(dim=1) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 17, 70, 300])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (100, 33), (7, 5), (65, 1)])
def test_q8_matches_float64_of_the_dequantized_weight(dtype, rows, out_features, in_features):
    q, scale = _q8(out_features, in_features)
    x = torch.randn(rows, in_features).to(dtype)
    bias = torch.randn(out_features).to(dtype)
    got = ops.skinny_linear_q8(x, pack_skinny_weight(q), scale, bias, out_features)
    want = x.double() @ (q.double() * scale.double()[:, None]).t() + bias.double()
    assert got.dtype == dtype and got.shape == (rows, out_features)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    none = ops.skinny_linear_q8(x, pack_skinny_weight(q), scale, None, out_features)
    torch.testing.assert_close(none.double(), want - bias.double(), rtol=tol,
                               atol=tol * want.abs().max().item())


def test_q8_rows_do_not_depend_on_the_batch():
    q, scale = _q8(130, 64, seed=3)
    slabs, x = pack_skinny_weight(q), torch.randn(9, 64)
    whole = ops.skinny_linear_q8(x, slabs, scale, None, 130)
    for i in range(9):
        assert torch.equal(ops.skinny_linear_q8(x[i:i + 1], slabs, scale, None, 130), whole[i:i + 1])


@pytest.mark.parametrize("bad", ["float weight", "scale length", "scale dtype", "unpacked"])
def test_q8_refuses_mismatched_operands(bad):
    q, scale = _q8(32, 16)
    slabs, x = pack_skinny_weight(q), torch.randn(2, 16)
    if bad == "float weight":
        slabs = slabs.float()
    elif bad == "scale length":
        scale = scale[:31]
    elif bad == "scale dtype":
        scale = scale.double()
    else:
        slabs = q
    with pytest.raises(RuntimeError, match="skinny_linear"):
        ops.skinny_linear_q8(x, slabs, scale, None, 32)
