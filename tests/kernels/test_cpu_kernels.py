"""kernels/cpu/ (the CPU backend) against the torch twins, the oracle.

Paged batches use shuffled physical blocks, ragged lengths crossing block boundaries and NaN in
every cache slot that must not be read (conftest.make_paged_batch). fp32 is held to a tight
tolerance (the batched decode sums the same products in a padded matmul) and the elementwise ops
to bitwise equality; bf16 to the twins' fp32 math within bf16 rounding. The fused C++ kernels
the backend calls are checked on their own in test_cpu_ext.py; here every decode path runs.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import cpu, twins
from tests.kernels.conftest import fused_qkv_views

FP32_TOL = 1e-5
BF16_TOL = 3e-2
BATCHES = {
    "decode": [(37, 1), (5, 1), (64, 1), (17, 1)],
    "prefill": [(37, 37), (5, 5), (20, 20)],
    # Decodes interleaved with fresh prefills and chunks that start mid-sequence (mid-block).
    "mixed": [(23, 23), (33, 1), (70, 13), (9, 1), (40, 8), (1, 1)],
    # One decode sequence, alone and between prefills.
    "one_decode": [(45, 1)],
    "one_decode_mixed": [(23, 23), (45, 1), (20, 7)],
}


@pytest.fixture(params=["fused", "batched", "per_sequence"])
def decode_path(request, monkeypatch):
    """Every decode attention path, whatever the plan would choose: the fused kernel (where
    it builds) and both torch paths the CPU backend falls back to without it."""
    if request.param == "fused":
        if cpu.fused_kernels() is None:
            pytest.skip("the fused CPU kernels did not build here")
    else:
        monkeypatch.setattr(cpu, "fused_kernels", lambda: None)
        forced = request.param == "per_sequence"
        monkeypatch.setattr(cpu, "per_sequence_decode", lambda lens: forced)
    return request.param


def test_decode_path_rule():
    assert cpu.per_sequence_decode((300,))  # a lone sequence
    assert cpu.per_sequence_decode((10, 900) * 2)  # lengths far apart
    assert not cpu.per_sequence_decode((160,) * 32)  # one length: no padding
    assert not cpu.per_sequence_decode((600, 620, 580))
    assert cpu.per_sequence_decode((50,) * 31 + (1500,))  # one long one: mostly padding


def _check(batch, tol):
    expected = twins.paged_attention(*batch.args())
    out = torch.full_like(batch.q, float("nan"))
    returned = cpu.paged_attention(*batch.args(), out=out)
    assert returned is out
    assert not out.isnan().any(), "unwritten or poisoned-read elements in the output"
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (14, 2), (8, 2)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_fp32(paged_batch, kind, num_heads, num_kv_heads, block_size,
                              decode_path):
    batch = paged_batch(BATCHES[kind], num_heads, num_kv_heads, 64, block_size, torch.float32,
                        torch.device("cpu"))
    _check(batch, FP32_TOL)


@pytest.mark.parametrize("kind", list(BATCHES))
def test_paged_attention_bf16(paged_batch, kind, decode_path):
    batch = paged_batch(BATCHES[kind], 14, 2, 64, 16, torch.bfloat16, torch.device("cpu"))
    _check(batch, BF16_TOL)


@settings(max_examples=30, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(1, 90), st.integers(1, 3)), min_size=1, max_size=20),
       group=st.sampled_from([1, 2, 7]), block_size=st.sampled_from([1, 4, 16]),
       seed=st.integers(0, 2**16))
def test_paged_attention_random_batches(seqs, group, block_size, seed):
    """Random mixes of decodes, fresh prefills and prefix chunks on random block tables."""
    from tests.kernels.conftest import make_paged_batch

    # kind 1: decode; 2: a fresh prefill of the whole sequence; 3: a chunk after a prefix.
    shaped = [(n, {1: 1, 2: n, 3: max(1, n // 3)}[kind]) for n, kind in seqs]
    batch = make_paged_batch(shaped, 2 * group, 2, 32, block_size, torch.float32,
                             torch.device("cpu"), seed=seed)
    _check(batch, FP32_TOL)


def test_fresh_prefill_from_new_keys_matches_cache_path(paged_batch):
    """A prefill without cached prefix attends to this step's keys passed in directly (no
    gather); the result equals reading them back from the cache."""
    batch = paged_batch(BATCHES["mixed"], 14, 2, 64, 16, torch.float32, torch.device("cpu"))
    plan = cpu.plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc, 16)
    # Read this step's keys and values back out of the cache, token row by token row.
    rows_k, rows_v = [], []
    starts = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        q_len = starts[i + 1] - starts[i]
        pos = torch.arange(seq_len - q_len, seq_len)
        blocks = batch.block_tables[i].long()[pos // 16]
        rows_k.append(batch.k_cache[blocks, pos % 16])
        rows_v.append(batch.v_cache[blocks, pos % 16])
    key, value = torch.cat(rows_k), torch.cat(rows_v)
    got = cpu.paged_attention_planned(batch.q, key, value, batch.k_cache, batch.v_cache, plan,
                                      batch.scale)
    expected = twins.paged_attention(*batch.args())
    torch.testing.assert_close(got, expected, atol=FP32_TOL, rtol=FP32_TOL)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (13, 896), (128, 32)])
def test_rms_norm_is_the_twin_bitwise(with_residual, shape):
    x, residual, weight = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
    if with_residual:
        out, new_residual = cpu.rms_norm(x, weight, 1e-6, residual)
        out_t, new_residual_t = twins.rms_norm(x, weight, 1e-6, residual)
        assert torch.equal(new_residual, new_residual_t)
    else:
        out, out_t = cpu.rms_norm(x, weight, 1e-6), twins.rms_norm(x, weight, 1e-6)
    assert torch.equal(out, out_t)


@pytest.mark.parametrize("kernel", ["extension", "torch"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [64, 48, 20])  # the whole head, or partial RoPE
def test_rotary_is_the_twin_bitwise(fused, dtype, kernel, rotary_dim, monkeypatch):
    if kernel == "torch":  # the fallback, whether or not the extension built here
        monkeypatch.setattr(cpu, "fused_kernels", lambda: None)
    elif cpu.fused_kernels() is None:
        pytest.skip("the fused CPU kernels did not build here")
    num_tokens, num_heads, num_kv_heads, head_dim = 11, 14, 2, 64
    cache = torch.randn(300, rotary_dim)
    positions = torch.randint(0, 300, (num_tokens,))
    # As the model hands them over: strided views of one fused qkv row (fused), or unrelated;
    # with partial RoPE, views of each head's first rotary_dim columns.
    qkv, q, k, _ = fused_qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    if not fused:
        k = k.clone()
    q_full, k_full = q, k
    q, k = q[..., :rotary_dim], k[..., :rotary_dim]
    # One pass over q and k together only when they are whole adjacent heads.
    assert len(cpu._rotary_operands(q, k)) == (1 if fused and rotary_dim == head_dim else 2)
    q_t, k_t = q_full.clone(), k_full.clone()
    qkv_before = qkv.clone()
    cpu.rotary(positions, q, k, cache)
    twins.rotary(positions, q_t[..., :rotary_dim], k_t[..., :rotary_dim], cache)
    assert torch.equal(q_full, q_t) and torch.equal(k_full, k_t)  # pass-through columns too
    v_cols = slice((num_heads + num_kv_heads) * head_dim, None)
    assert torch.equal(qkv[:, v_cols], qkv_before[:, v_cols]), "v must not be touched"


def test_silu_and_mul_is_the_twin_bitwise():
    x = torch.randn(9, 2 * 48)
    assert torch.equal(cpu.silu_and_mul(x), twins.silu_and_mul(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_is_the_twin(dtype):
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 6, 16, 2, 64, 40
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[: num_tokens // 4]] = -1  # padding
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = kv.split(num_kv_heads, dim=1)  # strided views, as the model gives them
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    twins.store_kv(key, value, k_expected, v_expected, slots)
    cpu.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.nan_to_num(7.0), k_expected.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_expected.nan_to_num(7.0))
