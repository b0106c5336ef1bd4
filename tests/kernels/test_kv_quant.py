"""The quantized KV cache (kernels/kv_quant.py): fp8 e4m3 with static per-head scales, int8 with
dynamic per-(position, head) scales, on every path that writes or reads it.

Oracles: the quantize-dequantize reference (a float64 batch holding exactly code * scale, run
through tests/kernels/attention_reference.py's query-by-query attention) and the twin. Paths:
the twin, the CPU backend's fused C++ kernels (decode and prefill) and its torch fallbacks
(batched and per-sequence decode, the per-sequence prefill), the Triton kernels under the
interpreter. The cases and oracles are tests/kernels/kv_quant_cases.py's, shared with the
compiled GPU tests (test_kv_quant_gpu.py: bf16, the prefill launch, softcap, real e4m3 rounding
in store_kv, a Llama-3-8B head layout).
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu, kv_quant, twins
from tests.kernels.conftest import DEVICE
from tests.kernels.kv_quant_cases import (
    BATCHES,
    BLOCK,
    HEAD_DIM,
    KV_DTYPES,
    NUM_HEADS,
    NUM_KV_HEADS,
    VARIANTS,
    case,
    check,
    check_store,
    expected_store,
    store_case,
)

# --- quantize / dequantize ------------------------------------------------------------------


def test_int8_rows_use_the_full_range_and_round_to_half_a_step():
    x = torch.randn(50, 3, 64, dtype=torch.float64) * torch.logspace(-3, 3, 50)[:, None, None]
    x[7, 1] = 0.0  # a zero row: scale 0, codes 0, exact
    codes, scale = kv_quant.quantize_rows(x, torch.int8)
    assert codes.dtype == torch.int8 and scale.shape == (50, 3) and scale.dtype == torch.float32
    assert codes.abs().amax(-1)[scale > 0].min() == 127  # each row's largest value is +-127
    assert scale[7, 1] == 0 and codes[7, 1].eq(0).all()
    err = (kv_quant.dequantize(codes, scale, torch.float64) - x).abs()
    # Half a step, and the fp32 rounding of the scale and of x / scale.
    assert (err <= scale.double()[..., None] * (0.5 + 1e-5) + 1e-30).all()


def test_fp8_codes_are_x_over_scale_rounded_and_saturated():
    scale = torch.tensor([[0.5, 2.0]])
    x = torch.tensor([[[1.0, -3.0, 1000.0, 0.0], [2.0, 7.0, -1e6, 0.001]]])
    codes, got_scale = kv_quant.quantize_rows(x, torch.float8_e4m3fn, scale)
    assert got_scale is scale
    expected = torch.tensor([[[2.0, -6.0, 448.0, 0.0], [1.0, 3.5, -448.0, 0.0005]]])
    assert torch.equal(codes.float(), expected.to(torch.float8_e4m3fn).float())
    assert kv_quant.dequantize(codes, scale)[0, 0, 2] == 224.0  # saturated, not inf or NaN


def test_kv_cache_dtype_names():
    assert kv_quant.kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_quant.kv_cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_quant.kv_cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert kv_quant.kv_cache_dtype("int8", torch.float16) == torch.int8
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, fp8"):
        kv_quant.kv_cache_dtype("fp8_e5m2", torch.bfloat16)
    # Bytes per element: fp8 1; int8 1 plus its fp32 scale per head row.
    assert kv_quant.bytes_per_element(torch.float8_e4m3fn, 64) == 1
    assert kv_quant.bytes_per_element(torch.int8, 64) == 1 + 4 / 64


# --- store_kv ---------------------------------------------------------------------------------


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_name", KV_DTYPES)
@pytest.mark.parametrize("impl", ["twin", "cpu"])
def test_store_kv_writes_codes_and_scales(impl, kv_name, q_dtype):
    kv_dtype = KV_DTYPES[kv_name]
    key, value, k_cache, v_cache, slots, k_scale, v_scale = store_case(kv_dtype, q_dtype)
    expected = expected_store(key, value, slots, kv_dtype, k_scale, v_scale)
    (twins if impl == "twin" else cpu).store_kv(key, value, k_cache, v_cache, slots, k_scale,
                                                v_scale)  # fmt: skip
    check_store(k_cache, v_cache, k_scale, v_scale, expected, kv_dtype, exact=True)


def _interpreter_rounds_e4m3_wrongly() -> bool:
    """Triton 3.9's interpreter converts fp32 to e4m3 wrongly (31.0 -> 16.0, subnormals to 0);
    the device's cvt.rn.satfinite does not, and the sm_90 compile test lowers the kernel."""
    if torch.cuda.is_available():
        return False
    import triton
    import triton.language as tl

    @triton.jit
    def convert(x_ptr, y_ptr):
        tl.store(y_ptr, tl.load(x_ptr).to(y_ptr.dtype.element_ty))

    y = torch.empty(1, dtype=torch.float8_e4m3fn)
    convert[(1,)](torch.tensor([31.0]), y)
    return y.float().item() != 32.0


@pytest.mark.parametrize("kv_name", KV_DTYPES)
def test_triton_store_kv_writes_codes_and_scales(triton_ops, kv_name):
    kv_dtype = KV_DTYPES[kv_name]
    if kv_dtype == torch.float8_e4m3fn and _interpreter_rounds_e4m3_wrongly():
        pytest.skip("Triton's interpreter rounds fp32 -> e4m3 wrongly (31.0 -> 16.0)")
    key, value, k_cache, v_cache, slots, k_scale, v_scale = store_case(kv_dtype, torch.float32)
    expected = expected_store(key, value, slots, kv_dtype, k_scale, v_scale)
    args = [t.to(DEVICE) for t in (key, value, k_cache, v_cache, slots, k_scale, v_scale)]
    triton_ops.store_kv(*args)
    k_cache, v_cache, k_scale, v_scale = (t.cpu() for t in (args[2], args[3], args[5], args[6]))
    check_store(k_cache, v_cache, k_scale, v_scale, expected, kv_dtype, exact=False)


# --- paged attention over a quantized cache ---------------------------------------------------

CPU_PATHS = {"decode": ["fused", "batched", "per_sequence"], "prefill": ["fused", "torch"],
             "chunked": ["fused", "torch"], "mixed": ["fused", "batched", "per_sequence"]}


def _use_path(path: str, monkeypatch) -> None:
    if path == "fused":
        if cpu.fused_kernels() is None:
            pytest.skip("the fused CPU kernels did not build here")
        return
    monkeypatch.setattr(cpu, "fused_kernels", lambda: None)  # as with FOLIO_CPU_EXT=0
    forced = path == "per_sequence"
    monkeypatch.setattr(cpu, "per_sequence_decode", lambda lens: forced)


@pytest.mark.parametrize("kv_name", KV_DTYPES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("kind", BATCHES)
def test_twin_attends_to_the_dequantized_cache(kind, name, q_dtype, kv_name):
    qb, args, reference = case(kind, name, q_dtype, kv_name)
    out = twins.paged_attention(*qb.args(), **args, **qb.scales())
    check(out, q_dtype, reference)


@pytest.mark.parametrize("kv_name", KV_DTYPES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("kind, path", [(k, p) for k, ps in CPU_PATHS.items() for p in ps])
def test_cpu_paths_match_twin_and_reference(kind, path, name, q_dtype, kv_name, monkeypatch):
    _use_path(path, monkeypatch)
    qb, args, reference = case(kind, name, q_dtype, kv_name)
    out = torch.full_like(qb.batch.q, float("nan"))
    assert cpu.paged_attention(*qb.args(), out=out, **args, **qb.scales()) is out
    check(out, q_dtype, reference)
    expected = twins.paged_attention(*qb.args(), **args, **qb.scales())
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[q_dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("path", ["fused", "torch"])
def test_cpu_fresh_prefill_reads_the_cache_not_the_new_keys(path, monkeypatch):
    """Given this step's unquantized keys, a quantized cache's prefill still attends to what
    the cache holds, as every other path and the twin do."""
    _use_path(path, monkeypatch)
    qb, args, reference = case("prefill", "plain", torch.float32, "int8")
    plan = cpu.plan_attention(qb.batch.block_tables, qb.batch.seq_lens,
                              qb.batch.query_start_loc, BLOCK)
    key = torch.randn(qb.batch.q.shape[0], NUM_KV_HEADS, HEAD_DIM)  # not what the cache holds
    got = cpu.paged_attention_planned(qb.batch.q, key, key, qb.batch.k_cache, qb.batch.v_cache,
                                      plan, qb.batch.scale, **qb.scales())
    check(got, torch.float32, reference)


def test_fused_kernels_refuse_scales_that_do_not_fit(monkeypatch):
    _use_path("fused", monkeypatch)
    qb, _, _ = case("decode", "plain", torch.float32, "int8")
    ops = cpu.fused_kernels()
    b = qb.batch
    out = torch.empty_like(b.q)
    with pytest.raises(RuntimeError, match="k_scale and v_scale come with an int8 or fp8"):
        ops.decode_attention(out, b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.scale)
    with pytest.raises(RuntimeError, match=r"KV scales must be \[num_blocks, block_size"):
        ops.decode_attention(out, b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens,
                             b.scale, k_scale=qb.k_scale[:, :, :1], v_scale=qb.v_scale)


# bf16 only compiled: Triton 3.9's interpreter computes tl.dot on bf16 operands wrongly.
TRITON_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda"
                                                   else [])


@pytest.mark.parametrize("kv_name", KV_DTYPES)
@pytest.mark.parametrize("q_dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("name", ["plain", "window", "sinks"])
@pytest.mark.parametrize("kind", ["decode", "mixed", "chunked"])
def test_triton_matches_reference(triton_ops, kind, name, q_dtype, kv_name):
    qb, args, reference = case(kind, name, q_dtype, kv_name)
    qb = qb.on(DEVICE)
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    out = torch.full_like(qb.batch.q, float("nan"))
    triton_ops.paged_attention(*qb.args(), out=out, **args, **qb.scales())
    check(out.cpu(), q_dtype, reference)


@pytest.mark.parametrize("kv_name", KV_DTYPES)
def test_triton_split_kv_matches_reference(triton_ops, kv_name):
    qb, args, reference = case("decode", "plain", torch.float32, kv_name)
    qb = qb.on(DEVICE)
    out = triton_ops.paged_attention(*qb.args(), num_splits=4, min_split_len=16, **qb.scales())
    check(out.cpu(), torch.float32, reference)


@pytest.mark.parametrize("kv_name", KV_DTYPES)
def test_store_then_attend_is_attention_over_quantized_keys(kv_name):
    """The round trip a layer makes, twin store then CPU attention: the output is within the
    quantization's error of attention over the exact keys (a loose bound: the reference is
    the quantize-dequantize one, checked above)."""
    kv_dtype = KV_DTYPES[kv_name]
    gen = torch.Generator().manual_seed(5)
    seq_len, num_blocks = 37, 12
    key = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    value = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    q = torch.randn(seq_len, NUM_HEADS, HEAD_DIM, generator=gen)
    shape = (num_blocks, BLOCK, NUM_KV_HEADS, HEAD_DIM)
    block_table = torch.randperm(num_blocks, generator=gen).int()[None]
    slots = (block_table[0].long()[torch.arange(seq_len) // BLOCK] * BLOCK
             + torch.arange(seq_len) % BLOCK)
    args = (block_table, torch.tensor([seq_len], dtype=torch.int32),
            torch.tensor([0, seq_len], dtype=torch.int32), seq_len, seq_len, HEAD_DIM**-0.5)
    exact_k, exact_v = torch.zeros(shape), torch.zeros(shape)
    twins.store_kv(key, value, exact_k, exact_v, slots)
    exact = twins.paged_attention(q, exact_k, exact_v, *args)
    k_cache, v_cache = torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)
    if kv_dtype == torch.int8:
        k_scale, v_scale = torch.zeros(shape[:3]), torch.zeros(shape[:3])
    else:
        k_scale = v_scale = kv_quant.static_scale_view(torch.ones(NUM_KV_HEADS), num_blocks, BLOCK)
    cpu.store_kv(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    got = cpu.paged_attention(q, k_cache, v_cache, *args, k_scale=k_scale, v_scale=v_scale)
    err = (got - exact).abs().max().item()
    # int8: steps of max|x| / 127 (~2.5% of sigma); fp8 e4m3: 2^-4 relative.
    assert 0 < err < (0.05 if kv_dtype == torch.int8 else 0.15)
