"""The CPU backend's attention variants (sliding window, logit soft-capping, sinks) against the
twin and the float64 reference, on every path kernels/cpu/ takes: the fused kernels, and the
torch paths of FOLIO_CPU_EXT=0 (batched or per-sequence decode, SDPA or explicit prefill).

Blocks wholly below a sequence's window hold NaN (poison_outside_windows: the block manager may
have freed and reused them), as does every slot past a sequence's length, so a read there shows.
GQA throughout (groups of 3 query heads per KV head), block size 4, so windows cross blocks.
"""

import functools
from unittest import mock

import pytest
import torch

from executor_svc.step.attention import PagedKernelsBackend
from executor_svc.step.batch import BatchMetadata
from kernels import cpu, twins
from tests.kernels.attention_reference import poison_outside_windows, reference_attention
from tests.kernels.conftest import make_paged_batch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 32, 4
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
REF_TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
# (seq_len including new tokens, q_len) per sequence.
BATCHES = {
    # Far past every window, shorter than most, and one with just its first token.
    "decode": [(70, 1), (6, 1), (33, 1), (19, 1), (1, 1)],
    # Fresh prompts longer and shorter than the windows.
    "prefill": [(21, 21), (9, 9)],
    # Chunks after a cached prefix, starting mid-block, past the window.
    "chunked": [(90, 11), (35, 6)],
    "mixed": [(19, 19), (70, 1), (41, 7), (6, 1), (300, 1)],
}
VARIANTS = {
    "window-1": dict(window=1),
    "window-6": dict(window=6),  # not a multiple of the block size
    "window-16": dict(window=16),
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=True),
    "all": dict(window=6, softcap=2.0, sinks=True),
}
# Which paths each kind of batch runs: the decode paths only matter where sequences decode.
PATHS = {"decode": ["fused", "batched", "per_sequence"], "prefill": ["fused", "torch"],
         "chunked": ["fused", "torch"], "mixed": ["fused", "batched", "per_sequence"]}
CASES = [(kind, path) for kind, paths in PATHS.items() for path in paths]


def variant_args(name: str) -> dict:
    args = dict(VARIANTS[name])
    if args.get("sinks"):
        args["sinks"] = torch.linspace(-2.0, 3.0, NUM_HEADS)
    return args


@functools.cache
def _case(kind: str, name: str, dtype: torch.dtype):
    """(batch, variant args, the twin's output, the float64 reference), once per session:
    the tests only read the batch."""
    batch = make_paged_batch(BATCHES[kind], NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK, dtype,
                             torch.device("cpu"), seed=len(kind) + len(name))
    args = variant_args(name)
    if args.get("window") and kind != "prefill":
        assert poison_outside_windows(batch, args["window"]) > 0
    return batch, args, twins.paged_attention(*batch.args(), **args), reference_attention(
        batch, **args)


def _use_path(path: str, monkeypatch) -> None:
    if path == "fused":
        if cpu.fused_kernels() is None:
            pytest.skip("the fused CPU kernels did not build here")
        return
    monkeypatch.setattr(cpu, "fused_kernels", lambda: None)  # as with FOLIO_CPU_EXT=0
    forced = path == "per_sequence"
    monkeypatch.setattr(cpu, "per_sequence_decode", lambda lens: forced)


def _check(got: torch.Tensor, dtype: torch.dtype, expected: torch.Tensor,
           reference: torch.Tensor) -> None:
    assert not got.isnan().any(), "an unwritten row, or a read below a window or past a length"
    torch.testing.assert_close(got.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got.double(), reference, atol=REF_TOL[dtype],
                               rtol=REF_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("kind, path", CASES)
def test_variant_matches_twin_and_reference(kind, path, name, dtype, monkeypatch):
    _use_path(path, monkeypatch)
    batch, args, expected, reference = _case(kind, name, dtype)
    out = torch.full_like(batch.q, float("nan"))
    assert cpu.paged_attention(*batch.args(), out=out, **args) is out
    _check(out, dtype, expected, reference)


@pytest.mark.parametrize("name", ["window-6", "softcap", "all"])
@pytest.mark.parametrize("path", ["fused", "torch"])
def test_fresh_prefill_from_new_keys(path, name, monkeypatch):
    """A prompt without cached prefix given this step's keys directly (the torch path then
    skips the gather) attends as from the cache."""
    _use_path(path, monkeypatch)
    batch, args, expected, reference = _case("mixed", name, torch.float32)
    key, value = _step_kv(batch)
    plan = cpu.plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc, BLOCK)
    got = cpu.paged_attention_planned(batch.q, key, value, batch.k_cache, batch.v_cache, plan,
                                      batch.scale, **args)
    _check(got, torch.float32, expected, reference)


@pytest.mark.parametrize("path", ["fused", "batched", "per_sequence"])
def test_one_plan_serves_layers_of_every_window(path, monkeypatch):
    """Local and global layers alternate (Gemma): one step's plan, windows in any order."""
    _use_path(path, monkeypatch)
    batch = make_paged_batch([(19, 19), (70, 1), (41, 7), (6, 1)], NUM_HEADS, NUM_KV_HEADS,
                             HEAD_DIM, BLOCK, torch.float32, torch.device("cpu"), seed=11)
    plan = cpu.plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc, BLOCK)
    for window in (6, 0, 16, 6, 0):
        got = cpu.paged_attention_planned(batch.q, None, None, batch.k_cache, batch.v_cache,
                                          plan, batch.scale, window=window)
        expected = twins.paged_attention(*batch.args(), window=window)
        torch.testing.assert_close(got, expected, atol=TOL[torch.float32], rtol=0)
    assert set(plan.windows) <= {6, 16}  # the torch path's per-window operands, once each


def test_windowed_torch_decode_gathers_only_the_window(monkeypatch):
    """The batched torch decode reads each sequence's window's blocks, not its context."""
    _use_path("batched", monkeypatch)
    lens = [400, 390, 7]
    batch = make_paged_batch([(n, 1) for n in lens], NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK,
                             torch.float32, torch.device("cpu"))
    poison_outside_windows(batch, 9)
    plan = cpu.plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc, BLOCK)
    got = cpu.paged_attention_planned(batch.q, None, None, batch.k_cache, batch.v_cache, plan,
                                      batch.scale, window=9)
    # 9 positions span at most 3 blocks of 4: 3 per sequence, not the 100 of the longest.
    assert plan.windows[9].block_ids.numel() == 3 * 3
    torch.testing.assert_close(got, twins.paged_attention(*batch.args(), window=9),
                               atol=TOL[torch.float32], rtol=0)


def _step_kv(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's keys and values, read back from the cache token row by token row."""
    rows_k, rows_v = [], []
    starts = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        pos = torch.arange(seq_len - (starts[i + 1] - starts[i]), seq_len)
        blocks = batch.block_tables[i].long()[pos // BLOCK]
        rows_k.append(batch.k_cache[blocks, pos % BLOCK])
        rows_v.append(batch.v_cache[blocks, pos % BLOCK])
    return torch.cat(rows_k), torch.cat(rows_v)


@pytest.mark.parametrize("path", ["fused", "batched"])
def test_backend_takes_the_planned_path_for_every_variant(path, monkeypatch):
    """PagedKernelsBackend: layers with and without variants share the step's one plan."""
    _use_path(path, monkeypatch)
    batch = make_paged_batch(BATCHES["mixed"], NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK,
                             torch.float32, torch.device("cpu"), seed=3)
    key, value = _step_kv(batch)
    starts = batch.query_start_loc.tolist()
    slots = torch.cat([
        batch.block_tables[i].long()[pos // BLOCK] * BLOCK + pos % BLOCK
        for i, seq_len in enumerate(batch.seq_lens.tolist())
        for pos in [torch.arange(seq_len - (starts[i + 1] - starts[i]), seq_len)]])
    meta = BatchMetadata(slot_mapping=slots, block_tables=batch.block_tables,
                         seq_lens=batch.seq_lens, query_start_loc=batch.query_start_loc,
                         max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
                         logits_indices=torch.zeros(1, dtype=torch.long))
    backend = PagedKernelsBackend()
    layers = [dict(window=6, softcap=2.0, sinks=torch.linspace(-1.0, 1.0, NUM_HEADS)),
              dict(), dict(window=16), dict(softcap=3.0)]
    with mock.patch.object(cpu, "plan_attention", wraps=cpu.plan_attention) as planned, \
            mock.patch.object(twins, "paged_attention", side_effect=AssertionError("twin")):
        outs = [backend.forward(batch.q, key, value, batch.k_cache, batch.v_cache, meta,
                                batch.scale, **args) for args in layers]
    assert planned.call_count == 1
    for got, args in zip(outs, layers, strict=True):
        torch.testing.assert_close(got.double(), reference_attention(batch, **args),
                                   atol=REF_TOL[torch.float32], rtol=REF_TOL[torch.float32])
