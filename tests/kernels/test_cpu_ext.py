"""The fused CPU kernels (kernels/csrc/) against the torch twins, the oracle.

rotary must be the twin's bitwise in every dtype, silu_and_mul in 16-bit dtypes (same rounding
points, the same exp); rms_norm within one rounding of the dtype (its mean sums in another order, so the
backend keeps torch's own op for fp32, which stays bitwise with transformers). Decode attention reads only each sequence's own positions: every other cache
slot holds NaN, so a stray read shows. Where the extension cannot be built (no compiler) these
tests skip, and test_cpu_kernels.py still runs the torch fallbacks.
"""

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import cpu, cpu_ext, twins
from tests.kernels.attention_reference import poison_outside_windows
from tests.kernels.conftest import fused_qkv_views, make_paged_batch

ops = cpu_ext.load()
pytestmark = pytest.mark.skipif(ops is None, reason="the fused CPU kernels did not build here")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _strided_rows(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, cols] as a view with a row stride wider than cols, like a slice of a fused row."""
    return torch.randn(rows, cols + 24).to(dtype)[:, 8:8 + cols]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows, hidden", [(1, 64), (13, 896), (7, 100), (33, 8)])
def test_rms_norm(dtype, with_residual, rows, hidden):
    x, weight = _strided_rows(rows, hidden, dtype), torch.randn(hidden).to(dtype)
    residual = torch.randn(rows, hidden).to(dtype) if with_residual else None
    got = ops.rms_norm(x, weight, 1e-6, residual)
    expected = twins.rms_norm(x, weight, 1e-6, residual)
    expected = expected if with_residual else (expected,)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == dtype and g.shape == e.shape
        # Sums in another order than torch's mean: at most one rounding of the dtype apart
        # (up to two units of eps relative, at the bottom of a binade).
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(g, e, rtol=2 * eps, atol=1e-5)
    if with_residual:
        assert torch.equal(got[1], expected[1]), "the residual sum is exact in every dtype"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(1, 64), (16, 4864), (5, 37)])
def test_silu_and_mul(dtype, rows, inter):
    x = _strided_rows(rows, 2 * inter, dtype) * 4  # reach silu's saturated tails too
    got, expected = ops.silu_and_mul(x), twins.silu_and_mul(x)
    if dtype == torch.float32:  # torch's scalar tail loop: the last ulp may differ there
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, rotary_dim", [
    (64, 64), (128, 128), (40, 40),
    # Partial RoPE: views of each head's first rotary_dim columns, the rest passing through.
    # Halves 48 (whole vectors), 15 and 6 (a tail, or nothing but the tail).
    (128, 96), (40, 30), (16, 12)])
def test_rotary_in_place_on_fused_qkv_views(dtype, head_dim, rotary_dim):
    num_tokens, num_heads, num_kv_heads = 9, 6, 2
    cache = torch.randn(500, rotary_dim)
    positions = torch.randint(0, 500, (num_tokens,))
    _, q, k, v = fused_qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    q_t, k_t, v_before = q.clone(), k.clone(), v.clone()
    ops.rotary(positions, q[..., :rotary_dim], k[..., :rotary_dim], cache)
    twins.rotary(positions, q_t[..., :rotary_dim], k_t[..., :rotary_dim], cache)
    assert torch.equal(q, q_t) and torch.equal(k, k_t)  # the pass-through columns too
    assert torch.equal(v, v_before), "v must not be touched"


def test_rotary_rejects_a_position_outside_the_cache():
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rotary(torch.tensor([0, 10]), q, k, torch.randn(10, 8))


def _decode_case(lens, group, num_kv_heads, head_dim, block_size, dtype, seed):
    batch = make_paged_batch([(n, 1) for n in lens], group * num_kv_heads, num_kv_heads,
                             head_dim, block_size, dtype, torch.device("cpu"), seed=seed)
    expected = twins.paged_attention(*batch.args())
    return batch, expected


def _decode(batch, out=None, **variant):
    out = torch.full_like(batch.q, float("nan")) if out is None else out
    ops.decode_attention(out, batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                         batch.seq_lens, batch.scale, **variant)
    return out


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.one_of(st.integers(1, 40), st.integers(200, 800)), min_size=1,
                    max_size=8),  # past 256 positions a sequence is split across work items
       group=st.sampled_from([1, 2, 3, 7]), num_kv_heads=st.sampled_from([1, 2, 3]),
       head_dim=st.sampled_from([64, 128, 40, 8]), block_size=st.sampled_from([1, 4, 16]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_decode_attention_matches_the_twin(lens, group, num_kv_heads, head_dim, block_size,
                                           dtype, seed):
    batch, expected = _decode_case(lens, group, num_kv_heads, head_dim, block_size, dtype, seed)
    got = _decode(batch)
    assert not got.isnan().any(), "a slot past a sequence's length was read"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_decode_attention_writes_through_strided_views():
    """q as a slice of the fused qkv rows and out as rows of a wider buffer: no copies."""
    batch, expected = _decode_case([30, 7, 64], 7, 2, 64, 16, torch.bfloat16, seed=3)
    num_seqs, num_heads, head_dim = batch.q.shape
    qkv = torch.randn(num_seqs, (num_heads + 4) * head_dim).to(torch.bfloat16)
    q = qkv[:, :num_heads * head_dim].view(num_seqs, num_heads, head_dim)
    q.copy_(batch.q)
    wide = torch.full((num_seqs + 2, num_heads, head_dim), float("nan"), dtype=torch.bfloat16)
    ops.decode_attention(wide[1:-1], q, batch.k_cache, batch.v_cache, batch.block_tables,
                         batch.seq_lens, batch.scale)
    torch.testing.assert_close(wide[1:-1].float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert wide[0].isnan().all() and wide[-1].isnan().all(), "rows outside the view written"


@pytest.mark.parametrize("variant", ["plain", "all"])
def test_decode_attention_is_batch_and_thread_invariant(variant):
    """A sequence's output is computed from its own rows only: alone or in a batch, on one
    thread or two, the bits are the same (what seeded sampling's batch invariance needs)."""
    batch, _ = _decode_case([90, 5, 300, 17, 777], 7, 2, 64, 16, torch.bfloat16, seed=5)
    args = _variant(variant, 14) if variant != "plain" else {}
    together = _decode(batch, **args)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = _decode(batch, **args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, one_thread)
    for i in range(len(batch.seq_lens)):
        alone = torch.empty_like(batch.q[i:i + 1])
        ops.decode_attention(alone, batch.q[i:i + 1], batch.k_cache, batch.v_cache,
                             batch.block_tables[i:i + 1], batch.seq_lens[i:i + 1], batch.scale,
                             **args)
        assert torch.equal(alone, together[i:i + 1])


@pytest.mark.parametrize("bad", ["seq_len", "block_id"])
def test_decode_attention_refuses_out_of_range_metadata(bad):
    batch, _ = _decode_case([20, 20], 2, 2, 64, 16, torch.float32, seed=1)
    tables, lens = batch.block_tables.clone(), batch.seq_lens.clone()
    if bad == "seq_len":
        lens[1] = tables.shape[1] * 16 + 1
    else:
        tables[0, 0] = batch.k_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside|out of range"):
        ops.decode_attention(torch.empty_like(batch.q), batch.q, batch.k_cache, batch.v_cache,
                             tables, lens, batch.scale)


def _prefill(batch, seq_ids, out=None, **variant):
    out = torch.full_like(batch.q, float("nan")) if out is None else out
    ops.prefill_attention(out, batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                          batch.query_start_loc, batch.seq_lens,
                          torch.tensor(seq_ids, dtype=torch.int32), batch.scale, **variant)
    return out


@settings(max_examples=40, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(1, 150), st.integers(0, 60)), min_size=1, max_size=6),
       group=st.sampled_from([1, 3, 7]), num_kv_heads=st.sampled_from([1, 2]),
       head_dim=st.sampled_from([16, 64, 128]), block_size=st.sampled_from([1, 4, 16]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_prefill_attention_matches_the_twin(seqs, group, num_kv_heads, head_dim, block_size,
                                            dtype, seed):
    """Prompts and chunks after a cached prefix (q_len <= seq_len), decodes mixed in: only the
    listed sequences' rows are written, each causally over its own blocks."""
    seqs = [(seq_len, max(1, min(seq_len, q_len))) for seq_len, q_len in seqs]
    batch = make_paged_batch(seqs, group * num_kv_heads, num_kv_heads, head_dim, block_size,
                             dtype, torch.device("cpu"), seed=seed)
    expected = twins.paged_attention(*batch.args())
    chosen = [i for i, (_, q_len) in enumerate(seqs) if q_len > 1 or i % 2]
    got = _prefill(batch, chosen)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    starts = batch.query_start_loc.tolist()
    for i in range(len(seqs)):
        rows = slice(starts[i], starts[i + 1])
        if i in chosen:
            assert not got[rows].isnan().any(), "a slot past a sequence's length was read"
            torch.testing.assert_close(got[rows].float(), expected[rows].float(), atol=tol,
                                       rtol=tol)
        else:
            assert got[rows].isnan().all(), "a sequence not listed was written"


@pytest.mark.parametrize("variant", ["plain", "all"])
def test_prefill_attention_is_batch_and_thread_invariant(variant):
    seqs = [(300, 300), (40, 25), (9, 1), (130, 64)]
    batch = make_paged_batch(seqs, 14, 2, 64, 16, torch.bfloat16, torch.device("cpu"), seed=7)
    args = _variant(variant, 14) if variant != "plain" else {}
    together = _prefill(batch, [0, 1, 2, 3], **args)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = _prefill(batch, [0, 1, 2, 3], **args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, one_thread)
    for i in range(len(seqs)):
        alone = _prefill(batch, [i], **args)
        rows = slice(int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1]))
        assert torch.equal(alone[rows], together[rows])


# Attention variants (twins.paged_attention defines them). Windows of 1, not a multiple of the
# block size, and wider than one decode work item (256 positions) so a window's chunks merge.
ATTENTION_VARIANTS = {
    "window-1": dict(window=1),
    "window-77": dict(window=77),
    "window-300": dict(window=300),
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=True),
    "all": dict(window=300, softcap=2.0, sinks=True),
}


def _variant(name: str, num_heads: int) -> dict:
    args = dict(ATTENTION_VARIANTS[name])
    if args.get("sinks"):
        args["sinks"] = torch.linspace(-2.0, 3.0, num_heads)
    return args


# 40: not whole AVX-512 vectors, the kernel's generic scoring path.
@pytest.mark.parametrize("head_dim, dtype", [(64, dt) for dt in DTYPES] + [(40, torch.float32)])
@pytest.mark.parametrize("name", ATTENTION_VARIANTS)
def test_decode_attention_variants_match_the_twin(name, head_dim, dtype):
    """Blocks wholly below each window hold NaN: a windowed decode never reads them."""
    batch, _ = _decode_case([700, 300, 17, 1, 257], 3, 2, head_dim, 4, dtype, seed=9)
    args = _variant(name, 6)
    if args.get("window"):
        poison_outside_windows(batch, args["window"])
    expected = twins.paged_attention(*batch.args(), **args)
    got = torch.full_like(batch.q, float("nan"))
    ops.decode_attention(got, batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                         batch.seq_lens, batch.scale, **args)
    assert not got.isnan().any(), "a slot below a window or past a length was read"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ATTENTION_VARIANTS)
def test_prefill_attention_variants_match_the_twin(name, dtype):
    """Prompts and chunks after a prefix past the window, tiles of rows whose windows start
    in different key tiles; blocks wholly below each sequence's first window hold NaN."""
    seqs = [(420, 420), (380, 35), (40, 1), (9, 9)]
    batch = make_paged_batch(seqs, 4, 2, 64, 16, dtype, torch.device("cpu"), seed=4)
    args = _variant(name, 4)
    if args.get("window"):
        poison_outside_windows(batch, args["window"])
    expected = twins.paged_attention(*batch.args(), **args)
    got = _prefill(batch, [0, 1, 2, 3], **args)
    assert not got.isnan().any(), "a slot below a window or past a length was read"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("bad", ["sinks_shape", "sinks_dtype", "window", "softcap"])
def test_attention_refuses_bad_variants(bad):
    batch = make_paged_batch([(20, 20), (30, 1)], 4, 2, 64, 16, torch.float32,
                             torch.device("cpu"), seed=1)
    args = {"sinks_shape": dict(sinks=torch.zeros(3)),
            "sinks_dtype": dict(sinks=torch.zeros(4, dtype=torch.float64)),
            "window": dict(window=-1), "softcap": dict(softcap=-1.0)}[bad]
    with pytest.raises(RuntimeError, match="sinks must|must be >= 0"):
        ops.decode_attention(torch.empty_like(batch.q), batch.q, batch.k_cache, batch.v_cache,
                             batch.block_tables, batch.seq_lens, batch.scale, **args)
    with pytest.raises(RuntimeError, match="sinks must|must be >= 0"):
        _prefill(batch, [0], **args)


def test_the_build_reports_the_isa_torch_dispatches_to():
    # The flags reached the compiler: the build's own macros name the ISA cpu_ext built it for.
    assert ops.isa() == cpu_ext.capability()
    lanes = {"AVX512": 16, "AVX2": 8}.get(ops.isa())
    assert lanes is None or ops.vector_width() == lanes
    assert cpu.fused_vector_width() == ops.vector_width()


@pytest.mark.parametrize("bad", ["seq_len", "block_id", "seq_id", "head_dim"])
def test_prefill_attention_refuses_bad_metadata(bad):
    # Whole fp32 vectors of a head: half a vector more is refused (40 with AVX512, 20 with AVX2).
    head_dim = 2 * ops.vector_width() + ops.vector_width() // 2 if bad == "head_dim" else 64
    batch = make_paged_batch([(20, 20), (30, 5)], 4, 2, head_dim, 16, torch.float32,
                             torch.device("cpu"), seed=1)
    tables, lens, ids = batch.block_tables.clone(), batch.seq_lens.clone(), [0, 1]
    if bad == "seq_len":
        lens[1] = 4  # shorter than its 5 query rows
    elif bad == "block_id":
        tables[0, 0] = batch.k_cache.shape[0]
    elif bad == "seq_id":
        ids = [2]
    with pytest.raises(RuntimeError, match="outside|out of range|not a sequence|multiple"):
        ops.prefill_attention(torch.empty_like(batch.q), batch.q, batch.k_cache, batch.v_cache,
                              tables, batch.query_start_loc, lens,
                              torch.tensor(ids, dtype=torch.int32), batch.scale)


def test_backend_uses_the_fused_kernels():
    """The CPU backend's plan picks the fused decode kernel and carries int32 tables."""
    batch = make_paged_batch([(40, 1), (9, 9), (17, 1)], 4, 2, 64, 16, torch.float32,
                             torch.device("cpu"))
    plan = cpu.plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc, 16)
    assert plan.decode_fused and plan.num_decode == 2
    assert plan.decode_tables.dtype == torch.int32 and plan.decode_tables.shape[0] == 2
    assert plan.decode_seq_lens.tolist() == [40, 17]
    assert plan.prefill_fused and plan.prefill_seq_ids.tolist() == [1]
    assert plan.block_tables.dtype == torch.int32 and plan.query_start_loc.dtype == torch.int32


@pytest.mark.parametrize("head_dim", [64, 40, 36])
def test_backend_prefill_matches_the_twin(head_dim):
    """Through the backend: the fused prefill kernel, or torch's SDPA for a head_dim the
    kernel does not take (not a multiple of its vector width: 40 with AVX512, 36 with both)."""
    batch = make_paged_batch([(40, 1), (50, 50), (70, 30)], 6, 2, head_dim, 16, torch.float32,
                             torch.device("cpu"), seed=2)
    plan = cpu.plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc, 16)
    got = cpu.paged_attention_planned(batch.q, None, None, batch.k_cache, batch.v_cache, plan,
                                      batch.scale)
    torch.testing.assert_close(got, twins.paged_attention(*batch.args()), atol=1e-5, rtol=1e-5)


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})


def test_env_switches_the_extension_off_and_a_failed_build_falls_back():
    code = ("from kernels import cpu_ext, cpu, twins; import torch;"
            "print(cpu_ext.load() is None);"
            "x = torch.randn(3, 64).bfloat16(); w = torch.ones(64).bfloat16();"
            "print(torch.equal(cpu.silu_and_mul(x), twins.silu_and_mul(x)))")
    off = _python(code, FOLIO_CPU_EXT="0")
    assert off.returncode == 0, off.stderr
    assert off.stdout.split() == ["True", "True"]
    # No compiler: auto logs why and runs the torch path; 1 refuses to start.
    broken = {"CXX": "/nonexistent/c++",
              "FOLIO_CPU_EXT_DIR": os.path.join(ROOT, ".pytest_cache", "no-compiler")}
    auto = _python(code, FOLIO_CPU_EXT="auto", **broken)
    assert auto.returncode == 0, auto.stderr
    assert auto.stdout.splitlines()[-2:] == ["True", "True"]
    assert "cpu kernels unavailable" in auto.stdout + auto.stderr
    required = _python(code, FOLIO_CPU_EXT="1", **broken)
    assert required.returncode != 0 and "did not build" in required.stderr
