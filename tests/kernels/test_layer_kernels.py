"""store_kv, rms_norm, rotary and silu_and_mul: Triton against the torch twins."""

import pytest
import torch

from kernels import twins

DTYPES = (torch.float32, torch.float16)


def _randn(*shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "block_size, num_kv_heads, head_dim", [(16, 2, 64), (32, 8, 128), (16, 3, 80)]
)
def test_store_kv(triton_ops, device, dtype, block_size, num_kv_heads, head_dim):
    num_blocks, num_tokens = 6, 40
    gen = torch.Generator().manual_seed(1)
    # Distinct slots across shuffled blocks, a quarter of them padding (-1).
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[: num_tokens // 4]] = -1
    slot_mapping = slots.to(device)
    # Key/value as strided views of a fused projection output, as the model hands them over.
    kv = _randn(num_tokens, 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
    key, value = kv.split(num_kv_heads, dim=1)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    twins.store_kv(key, value, k_expected, v_expected, slot_mapping)
    triton_ops.store_kv(key, value, k_cache, v_cache, slot_mapping)
    # Exact copies; padded slots and untouched slots still hold NaN.
    assert torch.equal(k_cache.isnan(), k_expected.isnan())
    assert (
        k_cache.isnan().sum()
        == (num_blocks * block_size - (slots >= 0).sum()) * num_kv_heads * head_dim
    )
    torch.testing.assert_close(k_cache, k_expected, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(triton_ops, device, tolerance, dtype, hidden, with_residual):
    num_tokens = 7
    # x as a row slice of a wider buffer: row stride != hidden.
    x = _randn(num_tokens, hidden + 8, dtype=dtype, device=device)[:, :hidden]
    weight = _randn(hidden, dtype=dtype, device=device, seed=1)
    residual = (
        _randn(num_tokens, hidden, dtype=dtype, device=device, seed=2) if with_residual else None
    )
    expected = twins.rms_norm(x, weight, 1e-6, residual)
    got = triton_ops.rms_norm(x, weight, 1e-6, residual)
    tol = tolerance[dtype]
    if with_residual:
        torch.testing.assert_close(got[1], expected[1], atol=0, rtol=0)  # same rounded sum
        got, expected = got[0], expected[0]
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, rotary_dim", [
    (8, 2, 64, 64), (4, 4, 128, 128), (6, 2, 80, 80),
    # Partial RoPE (Phi-4-mini: 96 of 128): q and k are views of each head's first rotary_dim
    # columns; 60 of 80 leaves a half (30) below its power-of-two block.
    (4, 2, 128, 96), (6, 2, 80, 60)])
def test_rotary(triton_ops, device, tolerance, dtype, num_heads, num_kv_heads, head_dim,
                rotary_dim):
    num_tokens, max_position = 9, 4096
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    angles = torch.arange(max_position).float()[:, None] * inv_freq[None, :]
    cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)  # fp32 cache
    positions = torch.randperm(max_position, generator=torch.Generator().manual_seed(3))[
        :num_tokens
    ]
    positions = positions.to(device)
    # q and k as views of one fused qkv projection output, rotated in place.
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device)
    q, k, _ = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1
    )
    q, k = q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)
    q_expected, k_expected = q.clone(), k.clone()
    twins.rotary(positions, q_expected[..., :rotary_dim], k_expected[..., :rotary_dim],
                 cos_sin_cache)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    q_pass, k_pass = q[..., rotary_dim:].clone(), k[..., rotary_dim:].clone()
    triton_ops.rotary(positions, q[..., :rotary_dim], k[..., :rotary_dim], cos_sin_cache)
    assert torch.equal(q[..., rotary_dim:], q_pass) and torch.equal(k[..., rotary_dim:], k_pass)
    tol = tolerance[dtype]
    torch.testing.assert_close(q, q_expected, atol=tol, rtol=tol)
    torch.testing.assert_close(k, k_expected, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [64, 88, 1500])
def test_silu_and_mul(triton_ops, device, tolerance, dtype, intermediate):
    x = _randn(5, 2 * intermediate, dtype=dtype, device=device)
    expected = twins.silu_and_mul(x)
    got = triton_ops.silu_and_mul(x)
    tol = tolerance[dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_rms_norm_on_a_qkv_view(triton_ops, device, tolerance, dtype):
    # Qwen3's q/k norm: rms_norm over head_dim of q, a strided view of the fused qkv output.
    num_tokens, num_heads, head_dim = 5, 4, 64
    qkv = _randn(num_tokens, 3 * num_heads * head_dim, dtype=dtype, device=device)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    weight = _randn(head_dim, dtype=dtype, device=device, seed=1)
    got = triton_ops.rms_norm(q, weight, 1e-6)
    assert got.shape == q.shape
    tol = tolerance[dtype]
    torch.testing.assert_close(got, twins.rms_norm(q, weight, 1e-6), atol=tol, rtol=tol)
    x = _randn(2, 3, 2 * 40, dtype=dtype, device=device)
    torch.testing.assert_close(
        triton_ops.silu_and_mul(x), twins.silu_and_mul(x), atol=tol, rtol=tol
    )
