"""The quantized skinny linears (kernels/csrc/skinny_linear_quant.cpp via kernels/cpu_quant.py)
against float64 products of the dequantized weight (GroupedWeight.dequantize, torch's fp8 cast),
bitwise against the fp32 skinny kernel on that same weight, row by row (a row's result does not
depend on the batch), and their refusals; fp8 layers through Fp8WeightOnly on the CPU backend.
"""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.models.linear import Linear, pack_skinny_weight
from executor_svc.quantization.grouped import GroupedWeight
from executor_svc.quantization.methods import (
    Fp8WeightOnly,
    quantized_weight,
    quantized_weight_bytes,
)
from kernels import cpu_ext, cpu_quant

ops = cpu_ext.load()
pytestmark = pytest.mark.skipif(ops is None, reason="the fused CPU kernels did not build here")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # of max |y|


def _grouped(n: int, k: int, bits: int, group_size: int, offsets: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    else:
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scales = torch.rand(n, k // group_size, generator=gen) * 0.02 + 1e-3
    off = torch.randn(n, k // group_size, generator=gen) * 0.1 if offsets else None
    return GroupedWeight(q, scales, off, group_size)


def _check_grouped(gw: GroupedWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    slabs = cpu_quant.pack_grouped(gw.q, gw.scales, gw.offsets, gw.group_size)
    got = cpu_quant.grouped_linear(x, slabs, bias)
    w = gw.dequantize()
    want = x.double() @ w.double().t() + (bias.double() if bias is not None else 0)
    assert got.dtype == x.dtype and got.shape == want.shape
    tol = TOLERANCE[x.dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    if x.dtype == torch.float32:  # exactly the fp32 dequantized weight, in skinny_linear's order
        assert torch.equal(got, ops.skinny_linear(x, pack_skinny_weight(w), bias, w.shape[0]))
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, 64, 300])
@pytest.mark.parametrize("bits, offsets", [(4, True), (8, True), (8, False)])
@pytest.mark.parametrize("n, k, group_size", [(37, 128, 32), (129, 256, 16), (16, 128, 128),
                                              (65, 192, 64), (7, 64, 32)])
def test_grouped_matches_float64_of_the_dequantized_weight(dtype, rows, bits, offsets, n, k,
                                                           group_size):
    gw = _grouped(n, k, bits, group_size, offsets, seed=rows + n)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    with_bias = _check_grouped(gw, x, bias)
    without = _check_grouped(gw, x, None)
    if dtype == torch.float32:  # the bias is added last, to the same fp32 sum
        assert torch.equal(with_bias, without + bias)


@pytest.mark.parametrize("bits", [4, 8])
def test_grouped_rows_do_not_depend_on_the_batch(bits):
    gw = _grouped(130, 256, bits, 32, offsets=True, seed=3)
    slabs = cpu_quant.pack_grouped(gw.q, gw.scales, gw.offsets, 32)
    x = torch.randn(37, 256)
    whole = cpu_quant.grouped_linear(x, slabs, None)  # staged through the fp32 scratch slab
    for i in range(37):
        one = cpu_quant.grouped_linear(x[i:i + 1], slabs, None)  # dequantized in registers
        assert torch.equal(one, whole[i:i + 1]), i
    assert torch.equal(cpu_quant.grouped_linear(x[:5], slabs, None), whole[:5])


@pytest.mark.parametrize("bits, offsets", [(4, True), (8, True), (8, False)])
def test_pack_unpack_round_trip(bits, offsets):
    gw = _grouped(45, 96, bits, 32, offsets, seed=1)
    slabs = cpu_quant.pack_grouped(gw.q, gw.scales, gw.offsets, 32)
    q, scales, off = slabs.unpack()
    assert q.dtype == gw.q.dtype and torch.equal(q, gw.q) and torch.equal(scales, gw.scales)
    assert (off is None) == (gw.offsets is None)
    assert off is None or torch.equal(off, gw.offsets)
    assert (slabs.out_features, slabs.in_features, slabs.bits, slabs.group_size) == (45, 96, bits, 32)
    code_bytes = 48 * 96 // (2 if bits == 4 else 1)  # N padded to 48
    assert slabs.nbytes() == code_bytes + 48 * 3 * 4 * (2 if offsets else 1)


@pytest.mark.parametrize("rows", [1, 5, 300])  # in registers, and staged through the scratch
@pytest.mark.parametrize("bits", [4, 8])
def test_fp16_exact_scales_are_stored_as_fp16_and_give_the_same_bits(rows, bits):
    """GGUF's scales and offsets are fp16 values: packed as fp16 they widen back exactly, so
    the product is the fp32-scale slabs' to the bit; one value fp16 cannot hold keeps fp32."""
    gw = _grouped(70, 256, bits, 32, offsets=True, seed=bits)
    scales, offsets = gw.scales.half().float(), gw.offsets.half().float()
    half = cpu_quant.pack_grouped(gw.q, scales, offsets, 32)
    assert half.scales.dtype == half.offsets.dtype == torch.float16
    wide = dataclasses.replace(half, scales=half.scales.float(), offsets=half.offsets.float())
    x = torch.randn(rows, 256)
    assert torch.equal(cpu_quant.grouped_linear(x, half, None),
                       cpu_quant.grouped_linear(x, wide, None))
    _check_grouped(GroupedWeight(gw.q, scales, offsets, 32), x, None)
    q, got_scales, got_offsets = half.unpack()
    assert got_scales.dtype == torch.float32 and torch.equal(got_scales, scales)
    assert torch.equal(got_offsets, offsets) and torch.equal(q, gw.q)
    code_bytes = 80 * 256 // (2 if bits == 4 else 1)
    assert half.nbytes() == code_bytes + 2 * 80 * 8 * 2
    offsets[3, 1] = 1e-9  # below fp16's range: not exact
    assert cpu_quant.pack_grouped(gw.q, scales, offsets, 32).scales.dtype == torch.float32


def test_scales_and_offsets_must_share_a_dtype():
    gw = _grouped(32, 64, 4, 16, offsets=True)
    s = cpu_quant.pack_grouped(gw.q, gw.scales.half().float(), gw.offsets.half().float(), 16)
    with pytest.raises(RuntimeError, match="scales and offsets alike"):
        ops.skinny_linear_g4(torch.randn(2, 64), s.q, s.scales, s.offsets.float(), None, 32, 16)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 12), n=st.integers(1, 70), groups=st.integers(1, 4),
       group_size=st.sampled_from([2, 8, 16, 32]), bits=st.sampled_from([4, 8]),
       offsets=st.booleans(), bias=st.booleans(), dtype=st.sampled_from([torch.float32,
                                                                         torch.bfloat16]))
def test_grouped_random_shapes(rows, n, groups, group_size, bits, offsets, bias, dtype):
    gw = _grouped(n, groups * group_size, bits, group_size, offsets or bits == 4, seed=n)
    x = torch.randn(rows, groups * group_size).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    if rows == 0:
        slabs = cpu_quant.pack_grouped(gw.q, gw.scales, gw.offsets, group_size)
        assert cpu_quant.grouped_linear(x, slabs, b).shape == (0, n)
    else:
        _check_grouped(gw, x, b)


def test_unsupported_shapes_are_refused_with_none():
    gw = _grouped(8, 96, 8, 32, offsets=False)
    assert cpu_quant.pack_grouped(gw.q, gw.scales[:, :2], None, 48) is not None  # 96 % 48 == 0
    assert cpu_quant.pack_grouped(gw.q[:, :90], gw.scales, None, 32) is None  # 90 % 32 != 0
    q4 = torch.randint(0, 16, (8, 93), dtype=torch.uint8)
    assert cpu_quant.pack_grouped(q4, torch.ones(8, 31), torch.zeros(8, 31), 3) is None  # odd
    assert cpu_quant.pack_grouped(gw.q, gw.scales, None, 0) is None


@pytest.mark.parametrize("bad", ["dtype", "scales shape", "scales dtype", "offsets shape",
                                 "codes past 15"])
def test_contradictory_operands_raise(bad):
    gw = _grouped(8, 64, 4, 32, offsets=True)
    q, scales, offsets = gw.q, gw.scales, gw.offsets
    if bad == "dtype":
        q = q.float()
    elif bad == "scales shape":
        scales = scales[:, :1]
    elif bad == "scales dtype":
        scales = scales.double()
    elif bad == "offsets shape":
        offsets = offsets[:7]
    else:
        q = q.clone()
        q[3, 5] = 16
    with pytest.raises(ValueError, match="q must|scales|offsets|0..15"):
        cpu_quant.pack_grouped(q, scales, offsets, 32)


@pytest.mark.parametrize("bad", ["x width", "slab dtype", "scales groups", "group size",
                                 "out_features", "bias dtype"])
def test_the_op_refuses_mismatched_operands(bad):
    gw = _grouped(32, 64, 4, 16, offsets=True)
    s = cpu_quant.pack_grouped(gw.q, gw.scales, gw.offsets, 16)
    x, q, scales, bias, n, gs = torch.randn(2, 64), s.q, s.scales, None, 32, 16
    if bad == "x width":
        x = torch.randn(2, 66)
    elif bad == "slab dtype":
        q = q.view(torch.int8)
    elif bad == "scales groups":
        scales = scales[:, :2].contiguous()
    elif bad == "group size":
        gs = 12
    elif bad == "out_features":
        n = 50
    else:
        bias = torch.randn(32, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="skinny_linear"):
        ops.skinny_linear_g4(x, q, scales, s.offsets, bias, n, gs)


# ---- fp8 e4m3 weights ----------------------------------------------------------------------

def _fp8(n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    scale = w.abs().amax(dim=1) / 448
    return (w / scale[:, None]).to(torch.float8_e4m3fn), scale


def test_fp8_widens_every_byte_exactly():
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = every[~every.float().isnan()]  # 254 values, subnormals and both zeros included
    w = torch.cat([finite, finite[:2]]).reshape(16, 16)
    got = cpu_quant.fp8_linear(torch.eye(16), cpu_quant.pack_fp8(w), torch.ones(16), None)
    assert torch.equal(got, w.float().t())
    nan = torch.tensor([[0x7F, 0x01], [0x10, 0xFF]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    got = cpu_quant.fp8_linear(torch.eye(2), cpu_quant.pack_fp8(nan), torch.ones(2), None)
    assert got[:, 0].isnan().all() and got[:, 1].isnan().all()  # NaN stays NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 5, 17, 300])
@pytest.mark.parametrize("n, k", [(960, 576), (100, 33), (7, 5)])
def test_fp8_matches_float64_of_the_dequantized_weight(dtype, rows, n, k):
    q, scale = _fp8(n, k, seed=rows)
    x = torch.randn(rows, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    slabs = cpu_quant.pack_fp8(q)
    assert torch.equal(cpu_quant.unpack_fp8(slabs, n).view(torch.uint8), q.view(torch.uint8))
    got = cpu_quant.fp8_linear(x, slabs, scale, bias)
    want = x.double() @ (q.double() * scale.double()[:, None]).t() + bias.double()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    if dtype == torch.float32:  # the same sums as the fp32 kernel's, then the scale
        plain = ops.skinny_linear(x, pack_skinny_weight(q.float()), None, n)
        assert torch.equal(got, plain * scale + bias)


def test_fp8_rows_do_not_depend_on_the_batch():
    q, scale = _fp8(130, 64, seed=3)
    slabs, x = cpu_quant.pack_fp8(q), torch.randn(11, 64)
    whole = cpu_quant.fp8_linear(x, slabs, scale, None)
    for i in range(11):
        assert torch.equal(cpu_quant.fp8_linear(x[i:i + 1], slabs, scale, None), whole[i:i + 1])


@pytest.mark.parametrize("bad", ["int8 weight", "scale length", "unpacked"])
def test_fp8_refuses_mismatched_operands(bad):
    q, scale = _fp8(32, 16)
    slabs, x = cpu_quant.pack_fp8(q), torch.randn(2, 16)
    if bad == "int8 weight":
        slabs = slabs.view(torch.int8)
    elif bad == "scale length":
        scale = scale[:31]
    else:
        slabs = q
    with pytest.raises(RuntimeError, match="skinny_linear"):
        ops.skinny_linear_f8(x, slabs, scale, None, 32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        cpu_quant.pack_fp8(q.view(torch.uint8))


@pytest.mark.parametrize("rows", [1, 9, 70])
def test_fp8_method_runs_the_slabs_on_the_cpu_backend(rows):
    torch.manual_seed(rows)
    layer = Linear(96, 40, bias=True)
    layer.method = Fp8WeightOnly()
    with torch.no_grad():
        layer.method.process_weights(layer)
    assert hasattr(layer, "f8_slabs") and layer.qweight.numel() == 0
    qweight = quantized_weight(layer)
    assert qweight.dtype == torch.float8_e4m3fn and qweight.shape == (40, 96)
    assert quantized_weight_bytes(layer) == 48 * 96 + 40 * 4  # slabs padded to 48 rows
    dequant = qweight.double() * layer.qscale.double()[:, None]
    x = torch.randn(rows, 96)
    with torch.no_grad():
        got = layer(x)
    want = x.double() @ dequant.t() + layer.bias.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(got, cpu_quant.fp8_linear(x, layer.f8_slabs, layer.qscale, layer.bias))


def test_without_the_fused_kernels_nothing_is_packed(monkeypatch):
    """FOLIO_CPU_EXT=0 or a failed build: pack_* return None and fp8 layers keep `qweight`."""
    monkeypatch.setattr(cpu_ext, "load", lambda: None)
    gw = _grouped(16, 64, 4, 32, offsets=True)
    assert cpu_quant.pack_grouped(gw.q, gw.scales, gw.offsets, 32) is None
    q, _ = _fp8(16, 64)
    assert cpu_quant.pack_fp8(q) is None
    layer = Linear(64, 16, bias=False)
    layer.method = Fp8WeightOnly()
    with torch.no_grad():
        layer.method.process_weights(layer)
    assert not hasattr(layer, "f8_slabs") and layer.qweight.shape == (16, 64)
    x = torch.randn(3, 64)
    want = x.double() @ (layer.qweight.double() * layer.qscale.double()[:, None]).t()
    with torch.no_grad():
        torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)
