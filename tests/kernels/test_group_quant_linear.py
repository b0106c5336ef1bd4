"""group_quant_linear: the torch twin against a float64 reference of x @ W^T + b with W the
GroupedWeight definition, and the Triton kernel (interpreter on CPU) against the twin: 4-bit
nibbles with offsets and 8-bit with and without them, act-order g_idx, odd shapes, groups
that straddle the kernel's K tiles."""

import pytest
import torch

from executor_svc.quantization.grouped import GroupedWeight, pack_int4, unpack_int4
from kernels import twins


def grouped(n: int, k: int, bits: int, group_size: int, *, offsets: bool = True,
            act_order: bool = False, seed: int = 0) -> GroupedWeight:
    gen = torch.Generator().manual_seed(seed)
    if act_order:  # GPTQ's desc_act: groups follow a permutation of the columns
        perm = torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group_size).to(torch.int32)
    else:
        g_idx = None
    groups = -(-k // group_size)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, groups, generator=gen) * 0.02 + 1e-3
    offs = torch.randn(n, groups, generator=gen) * 0.1 if offsets else None
    return GroupedWeight(q, scales, offs, group_size, g_idx)


def args(gw: GroupedWeight):
    qweight = pack_int4(gw.q) if gw.bits == 4 else gw.q
    return qweight, gw.scales, gw.offsets, gw.g_idx, gw.group_size


def reference(x, gw: GroupedWeight, bias):
    out = x.double() @ gw.dequantize().double().t()
    return out if bias is None else out + bias.double()


# (num_tokens, N, K, group_size): decode and prefill rows, odd N and K, a last group shorter
# than the others, groups smaller and larger than the kernel's K tile (32/64), one group.
SHAPES = [(1, 64, 64, 32), (1, 97, 131, 32), (3, 40, 200, 24), (17, 33, 70, 16),
          (70, 130, 96, 40), (5, 1, 9, 9), (2, 48, 256, 128)]
VARIANTS = [(4, True, False), (4, True, True), (8, False, False), (8, True, True)]


def test_pack_int4_round_trip():
    q = torch.randint(0, 16, (5, 7), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 4)
    assert torch.equal(unpack_int4(packed, 7), q)
    assert torch.equal(packed[:, 0], q[:, 0] | (q[:, 1] << 4))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_twin_against_float64(shape, variant, with_bias, monkeypatch):
    num_tokens, n, k, gs = shape
    bits, offsets, act_order = variant
    monkeypatch.setattr(twins, "DEQUANT_CHUNK_ELEMS", 7 * k)  # several slices, the last short
    gw = grouped(n, k, bits, gs, offsets=offsets, act_order=act_order)
    x = torch.randn(num_tokens, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n) if with_bias else None
    got = twins.group_quant_linear(x, *args(gw), bias)
    assert got.dtype == torch.float32 and got.shape == (num_tokens, n)
    torch.testing.assert_close(got.double(), reference(x, gw, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_against_twin(triton_ops, device, shape, variant, dtype):
    num_tokens, n, k, gs = shape
    bits, offsets, act_order = variant
    gw = grouped(n, k, bits, gs, offsets=offsets, act_order=act_order, seed=2)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(num_tokens, k + 5, generator=gen)[:, :k].to(dtype)  # row stride != K
    bias = torch.randn(n, generator=gen).to(dtype) if n % 2 else None
    expected = twins.group_quant_linear(x, *args(gw), bias)
    on_device = [t.to(device) if isinstance(t, torch.Tensor) else t for t in args(gw)]
    got = triton_ops.group_quant_linear(x.to(device), *on_device,
                                        None if bias is None else bias.to(device)).cpu()
    assert got.dtype == dtype and got.shape == (num_tokens, n)
    # fp32: product order and fused multiply-adds differ; fp16: W and the output are rounded
    # to fp16 in the kernel (the twin keeps fp32 weights).
    tol = 2e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol * 10)


def test_triton_refuses_bad_operands(triton_ops):
    gw = grouped(8, 16, 4, 8)
    qweight, scales, offsets, g_idx, gs = args(gw)
    x = torch.randn(2, 16)
    with pytest.raises(AssertionError, match="does not hold"):
        triton_ops.group_quant_linear(x[:, :8], qweight, scales, offsets, g_idx, gs, None)
    with pytest.raises(AssertionError, match="offsets needed"):
        triton_ops.group_quant_linear(x, qweight, scales, None, g_idx, gs, None)
    with pytest.raises(AssertionError, match="qweight dtype"):
        triton_ops.group_quant_linear(x, qweight.float(), scales, offsets, g_idx, gs, None)


# Launch configurations the heuristic may not pick on these shapes: whole-group K tiles with and
# without split-K, gathered tiles split, one split; K tiles shorter than the groups; the GEMV
# kernel (kernels/quant_gemv.py) split and not, also on more rows than it is picked for.
CONFIGS = [dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, TILE_GROUPS=True, SPLIT_K=3),
           dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, TILE_GROUPS=True, SPLIT_K=1),
           dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, TILE_GROUPS=False, SPLIT_K=5),
           dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, TILE_GROUPS=False),
           dict(BLOCK_N=16, BLOCK_K=64, GEMV=True, SPLIT_K=2),
           dict(BLOCK_N=64, BLOCK_K=32, GEMV=True)]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_launch_configs(triton_ops, device, config, bits, dtype):
    n, k, gs = 70, 328, 64  # K: five whole groups and a short one; N: a partial tile
    gw = grouped(n, k, bits, gs, offsets=True, seed=4)
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(n, generator=gen).to(dtype)
    on_device = [t.to(device) if isinstance(t, torch.Tensor) else t for t in args(gw)]
    for rows in (1, 19):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        expected = twins.group_quant_linear(x, *args(gw), bias)
        got = triton_ops.group_quant_linear(x.to(device), *on_device, bias.to(device),
                                            config=config).cpu()
        assert got.dtype == dtype and got.shape == (rows, n)
        tol = 2e-5 if dtype == torch.float32 else 4e-3
        torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol * 10)


def test_triton_refuses_tiles_across_groups(triton_ops):
    gw = grouped(8, 96, 8, 48)
    x = torch.randn(2, 96)
    config = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, TILE_GROUPS=True)
    with pytest.raises(AssertionError, match="TILE_GROUPS"):
        triton_ops.group_quant_linear(x, *args(gw), None, config=config)
