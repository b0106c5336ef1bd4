"""The quantized KV cache's Triton kernels compiled on a GPU: store_kv, the short (decode) and
long (prefill, chunked, mixed) attention launches and split-KV, over fp8 e4m3 and int8 caches,
with fp32, bf16 and fp16 queries.

Oracles, as in test_kv_quant.py (whose cases these are: tests/kernels/kv_quant_cases.py): the
float64 quantize-dequantize reference, the torch twin on the CPU over the same codes and
scales, and for store_kv the codes quantize_rows gives. What only a device shows: bf16 (the
interpreter's tl.dot on bf16 is wrong), fp32 -> e4m3 rounding in store_kv (the interpreter
rounds it wrongly), the compiled pointer dtypes and KV_QUANT flags, and a Llama-3-8B head
layout (32 query heads over 8 KV heads of 128, blocks of 16) at a few thousand keys.
"""

from __future__ import annotations

import pytest
import torch

from kernels import kv_quant, twins
from tests.kernels.conftest import TOLERANCE
from tests.kernels.kv_quant_cases import (
    BATCHES,
    BLOCK,
    HEAD_DIM,
    KV_DTYPES,
    NUM_KV_HEADS,
    REF_TOL,
    VARIANTS,
    QuantBatch,
    case,
    check,
    check_store,
    expected_store,
    quant_case,
    store_case,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
Q_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _on_cuda(args: dict) -> dict:
    return {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _attend(triton_ops, qb: QuantBatch, args: dict, **launch) -> torch.Tensor:
    """The Triton kernel's output on the CPU, into an output poisoned with NaN."""
    on = qb.on(CUDA)
    out = torch.full_like(on.batch.q, float("nan"))
    triton_ops.paged_attention(*on.args(), out=out, **_on_cuda(args), **on.scales(), **launch)
    torch.cuda.synchronize()
    return out.cpu()


def _check(got: torch.Tensor, qb: QuantBatch, args: dict, reference: torch.Tensor) -> None:
    """Against the float64 reference (the shared check: no NaN, the absolute tolerance), then
    against it and the twin over the same codes and scales (CPU, the query's dtype) relative
    to the output's largest magnitude: the V rows are small (0.02 sigma), so an absolute
    tolerance alone would pass an output of zeros."""
    q_dtype = qb.batch.q.dtype
    check(got, q_dtype, reference)
    magnitude = reference.abs().max().item()
    assert magnitude > 0
    torch.testing.assert_close(got.double() / magnitude, reference / magnitude,
                               atol=REF_TOL[q_dtype], rtol=0)
    expected = twins.paged_attention(*qb.args(), **args, **qb.scales())
    torch.testing.assert_close(got.double() / magnitude, expected.double() / magnitude,
                               atol=TOLERANCE[q_dtype], rtol=0)


# --- store_kv ---------------------------------------------------------------------------------


@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=str)
@pytest.mark.parametrize("kv_name", KV_DTYPES)
def test_store_kv_writes_codes_and_scales(triton_ops, kv_name, q_dtype):
    kv_dtype = KV_DTYPES[kv_name]
    key, value, k_cache, v_cache, slots, k_scale, v_scale = store_case(kv_dtype, q_dtype)
    expected = expected_store(key, value, slots, kv_dtype, k_scale, v_scale)
    args = [t.to(CUDA) for t in (key, value, k_cache, v_cache, slots, k_scale, v_scale)]
    triton_ops.store_kv(*args)
    k_cache, v_cache, k_scale, v_scale = (t.cpu() for t in (args[2], args[3], args[5], args[6]))
    check_store(k_cache, v_cache, k_scale, v_scale, expected, kv_dtype, exact=False)


def _e4m3_grid() -> torch.Tensor:
    """Every finite e4m3 value, the midpoint between each pair of neighbours (a round-to-even
    tie), points a quarter step either side of it, and values past +-448 (saturation), both
    signs: [n] fp32, each exactly representable in bf16 and fp16 too."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    values = codes.float()
    values = values[values.isfinite() & (values >= 0)].unique()  # sorted, 0 .. 448
    mid = (values[1:] + values[:-1]) / 2
    quarter = (values[1:] - values[:-1]) / 4
    grid = torch.cat([values, mid, mid - quarter, mid + quarter,
                      torch.tensor([456.0, 464.0, 480.0, 2048.0])])
    return torch.cat([grid, -grid])


@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=str)
def test_store_kv_rounds_to_e4m3_as_torch_does(triton_ops, q_dtype):
    """Power-of-two scales make x / scale exact on any device, so the codes must equal torch's
    fp32 -> e4m3 cast (round to nearest even, subnormals, saturation to +-448) bit for bit:
    the case the interpreter skips (tests/kernels/test_kv_quant.py)."""
    grid = _e4m3_grid()
    row = NUM_KV_HEADS * HEAD_DIM
    num_tokens = -(-grid.numel() // row)
    x = torch.zeros(num_tokens * row)
    x[:grid.numel()] = grid
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))]
    num_blocks = -(-num_tokens // BLOCK) + 1
    heads = torch.tensor([0.5, 2.0]).repeat(NUM_KV_HEADS)[:NUM_KV_HEADS]  # per KV head
    scale = kv_quant.static_scale_view(heads, num_blocks, BLOCK)
    key = (x.view(num_tokens, NUM_KV_HEADS, HEAD_DIM) * heads[:, None]).to(q_dtype)
    assert torch.equal(key.float() / heads[:, None], x.view_as(key)), "grid not exact"
    value = key.flip(0)
    slots = torch.randperm(num_blocks * BLOCK, generator=torch.Generator().manual_seed(2))
    slots = slots[:num_tokens]
    shape = (num_blocks, BLOCK, NUM_KV_HEADS, HEAD_DIM)
    caches = [torch.zeros(shape, dtype=torch.float8_e4m3fn, device=CUDA) for _ in range(2)]
    triton_ops.store_kv(key.to(CUDA), value.to(CUDA), *caches, slots.to(CUDA),
                        scale.to(CUDA), scale.to(CUDA))
    expected = expected_store(key, value, slots, torch.float8_e4m3fn, scale, scale)
    check_store(caches[0].cpu(), caches[1].cpu(), scale, scale, expected, torch.float8_e4m3fn,
                exact=True)


# --- attention over a quantized cache ---------------------------------------------------------


@pytest.mark.parametrize("kv_name", KV_DTYPES)
@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=str)
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("kind", BATCHES)
def test_attention_matches_reference_and_twin(triton_ops, kind, name, q_dtype, kv_name):
    """decode: the short launch; prefill, chunked and mixed: the long one."""
    qb, args, reference = case(kind, name, q_dtype, kv_name)
    got = _attend(triton_ops, qb, args)
    _check(got, qb, args, reference)


@pytest.mark.parametrize("kv_name", KV_DTYPES)
@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=str)
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_split_kv_matches_reference_and_twin(triton_ops, kind, name, q_dtype, kv_name):
    """Four splits of at least 16 keys: the 300-key sequences split, the short ones do not,
    and the merge combines partial results computed over quantized keys."""
    qb, args, reference = case(kind, name, q_dtype, kv_name)
    got = _attend(triton_ops, qb, args, num_splits=4, min_split_len=16)
    _check(got, qb, args, reference)


# Llama-3-8B's attention: 32 query heads, 8 KV heads of 128, blocks of 16.
LLAMA_HEADS = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
LLAMA_BATCHES = {
    "decode": [(3000, 1), (17, 1), (1024, 1), (513, 1), (2049, 1)],
    "mixed": [(700, 64), (1500, 1), (96, 96), (33, 1)],
}


@pytest.mark.parametrize("kv_name", KV_DTYPES)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["plain", "window"])
@pytest.mark.parametrize("kind", LLAMA_BATCHES)
def test_llama_heads_match_reference_and_twin(triton_ops, kind, name, q_dtype, kv_name):
    """Real head sizes and thousands of keys, with the launcher's own split choice and with
    forced splits (a window of 6 keys reads a block or two of each sequence)."""
    qb, args, reference = quant_case(LLAMA_BATCHES[kind], name, q_dtype, kv_name, seed=9,
                                     **LLAMA_HEADS)
    for launch in ({}, dict(num_splits=8, min_split_len=64)):
        got = _attend(triton_ops, qb, args, **launch)
        _check(got, qb, args, reference)
