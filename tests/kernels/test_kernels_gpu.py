"""Compiled kernels on a GPU at realistic sizes, in bf16 and fp16, against fp32 references.

Shapes are Llama-3.1-8B's (32 q heads, 8 KV heads, head_dim 128, hidden 4096, FFN 14336) with
contexts to 32k, plus Qwen2.5-0.5B's head_dim-64, 7-way GQA attention.
"""

import pytest
import torch

import kernels
from kernels import twins

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DTYPES = (torch.bfloat16, torch.float16)
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
CUDA = torch.device("cuda")


def _random_lengths(num: int, low: int, high: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (num,), generator=gen).tolist()


BATCHES = {
    "decode-16x32k": lambda: [(n, 1) for n in _random_lengths(15, 1, 32768, 0)] + [(32768, 1)],
    "decode-1x32k": lambda: [(32768, 1)],
    "decode-256x1k": lambda: [(n, 1) for n in _random_lengths(256, 1, 1024, 1)],
    "prefill-4k": lambda: [(4096, 4096), (1000, 1000)],
    # Chunked prefill of a long prompt next to a fresh prompt and a crowd of decodes.
    "mixed-32k": lambda: (
        [(32768, 2048), (777, 777)] + [(n, 1) for n in _random_lengths(30, 1, 8192, 2)]
    ),
}


def _reference(batch) -> torch.Tensor:
    """The twin in fp32 on upcast inputs: the inputs are the same, only the math differs."""
    args = list(batch.args())
    args[0], args[1], args[2] = (t.float() for t in args[:3])
    return twins.paged_attention(*args)


def _check(triton_ops, batch, **kwargs):
    out = torch.full_like(batch.q, float("nan"))
    triton_ops.paged_attention(*batch.args(), out=out, **kwargs)
    assert not out.isnan().any()
    tol = TOL[batch.q.dtype]
    torch.testing.assert_close(out.float(), _reference(batch), atol=tol, rtol=tol)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", BATCHES)
def test_attention_8b_shapes(triton_ops, paged_batch, dtype, kind):
    batch = paged_batch(BATCHES[kind](), 32, 8, 128, 16, dtype, device=CUDA)
    out = _check(triton_ops, batch)
    again = torch.full_like(out, float("nan"))
    triton_ops.paged_attention(*batch.args(), out=again)
    assert torch.equal(out, again), "two identical launches differ: a race"


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_head_dim_64_gqa7(triton_ops, paged_batch, dtype):
    seqs = [(3000, 1), (500, 500), (9000, 300)] + [(n, 1) for n in _random_lengths(20, 1, 4096, 3)]
    _check(triton_ops, paged_batch(seqs, 14, 2, 64, 16, dtype, device=CUDA))


@pytest.mark.parametrize("num_splits", [1, 8, 64])
def test_split_kv_agrees_with_single_pass(triton_ops, paged_batch, num_splits):
    batch = paged_batch([(32768, 1), (20000, 1)], 32, 8, 128, 32, torch.bfloat16, device=CUDA)
    _check(triton_ops, batch, num_splits=num_splits)


def test_public_dispatch_runs_triton_on_cuda(triton_ops, paged_batch):
    batch = paged_batch([(100, 1), (50, 50)], 32, 8, 128, 16, torch.bfloat16, device=CUDA)
    out = kernels.paged_attention(*batch.args())
    # The kernel is deterministic, so the public entry point must reproduce it bit for bit.
    assert torch.equal(out, triton_ops.paged_attention(*batch.args()))
    torch.testing.assert_close(out.float(), _reference(batch), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_8b_shapes(triton_ops, dtype):
    num_blocks, block_size, num_tokens = 512, 16, 2048
    slots = torch.randperm(num_blocks * block_size, device=CUDA)[:num_tokens]
    slots[::7] = -1
    key = torch.randn(num_tokens, 8, 128, device=CUDA, dtype=dtype)
    value = torch.randn(num_tokens, 8, 128, device=CUDA, dtype=dtype)
    k_cache = torch.full((num_blocks, block_size, 8, 128), float("nan"), device=CUDA, dtype=dtype)
    v_cache = k_cache.clone()
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    twins.store_kv(key, value, k_expected, v_expected, slots)
    triton_ops.store_kv(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, k_expected, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_8b_shapes(triton_ops, dtype):
    num_tokens, tol = 1000, TOL[dtype]
    x = torch.randn(num_tokens, 4096, device=CUDA, dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(4096, device=CUDA, dtype=dtype)
    out, new_residual = triton_ops.rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_residual = twins.rms_norm(x.float(), weight.float(), 1e-5, residual.float())
    torch.testing.assert_close(new_residual.float(), ref_residual, atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), ref_out, atol=4 * tol, rtol=4 * tol)

    gate_up = torch.randn(num_tokens, 2 * 14336, device=CUDA, dtype=dtype)
    torch.testing.assert_close(triton_ops.silu_and_mul(gate_up).float(),
                               twins.silu_and_mul(gate_up.float()), atol=tol, rtol=tol)  # fmt: skip

    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device=CUDA).float() / 128))
    angles = torch.arange(32768, device=CUDA).float()[:, None] * inv_freq[None, :]
    cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.randint(0, 32768, (num_tokens,), device=CUDA)
    qkv = torch.randn(num_tokens, 48 * 128, device=CUDA, dtype=dtype)
    q, k, _ = qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)
    q, k = q.view(num_tokens, 32, 128), k.view(num_tokens, 8, 128)
    q_ref, k_ref = q.float(), k.float()
    twins.rotary(positions, q_ref, k_ref, cos_sin_cache)
    triton_ops.rotary(positions, q, k, cos_sin_cache)
    torch.testing.assert_close(q.float(), q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(k.float(), k_ref, atol=tol, rtol=tol)


def _variants(jit_fn) -> int:
    return sum(len(caches[0]) for caches in jit_fn.device_caches.values())


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_steps_never_recompile(triton_ops, paged_batch, dtype):
    # Steps of a fixed decode batch shape (what a captured graph replays) with lengths, block
    # table widths and split counts changing: after the first step nothing compiles again, and
    # every step stays exact with one preallocated scratch.
    from kernels import attention, attention_reduce

    partial, lse = attention.alloc_scratch(8, 32, 128, 64, CUDA)
    counts = []
    for step in range(12):
        lengths = _random_lengths(8, 1, 1 << (8 + step % 7), step)
        batch = paged_batch([(n, 1) for n in lengths], 32, 8, 128, 16, dtype, device=CUDA,
                            seed=step)  # fmt: skip
        out = _check(triton_ops, batch, num_splits=16, scratch=(partial, lse))
        assert out.isfinite().all()
        counts.append(_variants(attention._paged_attention_kernel)
                      + _variants(attention_reduce._merge_splits_kernel))  # fmt: skip
    assert len(set(counts)) == 1, f"compiled variants per step: {counts}"


def test_mixed_step_with_splits_and_scratch(triton_ops, paged_batch):
    from kernels import attention

    seqs = [(9000, 1), (4096, 2048), (777, 777)] + [(n, 1) for n in _random_lengths(5, 1, 8192, 4)]
    batch = paged_batch(seqs, 32, 8, 128, 16, torch.bfloat16, device=CUDA)
    scratch = attention.alloc_scratch(batch.q.shape[0], 32, 128, 8, CUDA)
    _check(triton_ops, batch, num_splits=8, scratch=scratch)
