"""paged_attention: the Triton kernel against its torch twin (interpreted on CPU, compiled on GPU).

Every batch uses shuffled physical blocks, ragged lengths crossing block boundaries, NaN in every
cache slot it must not read, and a NaN-poisoned output so an unwritten element shows. The
variants (sliding window, softcap, sinks) are also checked against the float64 reference, with
NaN in every block wholly below a sequence's window.
"""

import itertools

import pytest
import torch

from kernels import twins
from tests.kernels.conftest import DEVICE

NUM_KV_HEADS = 2
BATCHES = {
    "decode": [(37, 1), (5, 1), (64, 1), (17, 1)],
    "prefill": [(37, 37), (5, 5), (20, 20)],
    # A fresh prefill, decodes, and chunks of longer prompts starting mid-sequence (mid-block).
    "mixed": [(23, 23), (33, 1), (70, 13), (9, 1), (40, 8)],
}
DTYPES = (torch.float32, torch.float16)
HEAD_DIMS = (64, 128, 80)
CASES = [
    pytest.param(kind, group, dtype, head_dim, block_size,
                 id=f"{kind}-gqa{group}-{str(dtype)[6:]}-d{head_dim}-bs{block_size}")
    for kind, group, dtype, head_dim, block_size in itertools.product(
        BATCHES, (1, 4, 8), DTYPES, HEAD_DIMS, (16, 32)
    )
]  # fmt: skip


def _check(triton_ops, batch, tolerance, **kwargs):
    expected = twins.paged_attention(*batch.args())
    out = torch.full_like(batch.q, float("nan"))
    returned = triton_ops.paged_attention(*batch.args(), out=out, **kwargs)
    assert returned is out
    assert not out.isnan().any(), "unwritten or poisoned-read elements in the output"
    tol = tolerance[batch.q.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("kind, group, dtype, head_dim, block_size", CASES)
def test_matches_twin(triton_ops, paged_batch, tolerance, kind, group, dtype, head_dim, block_size):
    batch = paged_batch(
        BATCHES[kind], group * NUM_KV_HEADS, NUM_KV_HEADS, head_dim, block_size, dtype
    )
    _check(triton_ops, batch, tolerance)


@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_kv_matches_twin(triton_ops, paged_batch, tolerance, kind, num_splits, dtype):
    # Long enough that each split holds several key tiles, one sequence short enough that its
    # later splits are empty.
    seqs = [(300, 1), (21, 1)] if kind == "decode" else [(300, 7), (21, 21), (150, 1)]
    batch = paged_batch(seqs, 4 * NUM_KV_HEADS, NUM_KV_HEADS, 64, 16, dtype)
    _check(triton_ops, batch, tolerance, num_splits=num_splits, min_split_len=64)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(14, 2, 64), (6, 3, 96)])
def test_odd_group_and_head_dim(
    triton_ops, paged_batch, tolerance, num_heads, num_kv_heads, head_dim
):
    # Group sizes that are not powers of two (Qwen2.5-0.5B has 14 heads over 2 KV heads).
    batch = paged_batch(BATCHES["mixed"], num_heads, num_kv_heads, head_dim, 16, torch.float32)
    _check(triton_ops, batch, tolerance)


def test_any_softmax_scale(triton_ops, paged_batch, tolerance):
    batch = paged_batch(BATCHES["mixed"], 8, 2, 64, 16, torch.float32)
    batch.scale = 0.37
    _check(triton_ops, batch, tolerance)


def test_max_seq_len_is_unused(triton_ops, paged_batch, tolerance):
    # Splits follow each sequence's length on the device: an underestimated max_seq_len (what
    # a captured graph would have frozen) changes nothing.
    batch = paged_batch([(200, 1), (90, 3)], 8, 2, 64, 16, torch.float32)
    batch.max_seq_len = 100
    _check(triton_ops, batch, tolerance, num_splits=3, min_split_len=64)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_sequences_without_queries(triton_ops, paged_batch, tolerance, num_splits):
    # A sequence scheduled with no tokens this step (a padded entry) owns no output rows.
    batch = paged_batch([(130, 1), (40, 0), (70, 5)], 8, 2, 64, 16, torch.float32)
    _check(triton_ops, batch, tolerance, num_splits=num_splits, min_split_len=32)


# Variants (kernels/twins.py::paged_attention defines them), against the twin and the float64
# reference. Windowed batches hold NaN in every block wholly below a sequence's first window
# (as a block the manager freed and reused), so reading one shows in the output.
VARIANTS = {
    "window": dict(window=16),
    "window-1": dict(window=1),
    "window-odd": dict(window=21),  # no multiple of any block size or key tile
    "softcap": dict(softcap=5.0),
    "sinks": dict(sinks=True),
    "all": dict(window=16, softcap=5.0, sinks=True),
}
VARIANT_BATCHES = {
    "decode": [(70, 1), (6, 1), (33, 1), (129, 1)],
    # A fresh prompt and a chunk deep into a sequence (its window starts past whole key tiles).
    "prefill": [(45, 45), (150, 40), (20, 20)],
    "mixed": [(70, 1), (45, 45), (90, 13), (6, 1), (33, 8)],
}


def _variant_args(variant: dict, num_heads: int) -> dict:
    args = dict(variant)
    if args.get("sinks"):
        # Around the scores' range: some heads' sinks dominate, some barely count.
        args["sinks"] = torch.linspace(-2.0, 4.0, num_heads, device=DEVICE)
    return args


def _check_variant(triton_ops, batch, args, tolerance, **kwargs):
    from tests.kernels.attention_reference import poison_outside_windows, reference_attention

    if args.get("window"):
        poison_outside_windows(batch, args["window"])
    out = torch.full_like(batch.q, float("nan"))
    assert triton_ops.paged_attention(*batch.args(), out=out, **args, **kwargs) is out
    assert not out.isnan().any(), "unwritten or poisoned-read elements in the output"
    tol = tolerance[batch.q.dtype]
    expected = twins.paged_attention(*batch.args(), **args)
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    reference = reference_attention(batch, **args).to(out.device)
    torch.testing.assert_close(out.double(), reference, atol=tol, rtol=tol)


# A selection, not the product: every variant on every kind of batch, each with both GQA
# groups and both dtypes somewhere, block sizes below, at and above the key tiles.
VARIANT_CASES = [
    pytest.param(name, kind, group, dtype, block_size, 80 if name == "all" and kind == "mixed" else 32,
                 id=f"{name}-{kind}-gqa{group}-{str(dtype)[6:]}-bs{block_size}")
    for i, (name, kind) in enumerate(itertools.product(VARIANTS, VARIANT_BATCHES))
    for group, dtype, block_size in [((1, 4)[i % 2], DTYPES[i // 2 % 2], (8, 16, 32)[(i + i // 3) % 3])]
]  # fmt: skip


@pytest.mark.parametrize("name, kind, group, dtype, block_size, head_dim", VARIANT_CASES)
def test_variants_match_twin_and_reference(triton_ops, paged_batch, tolerance, name, kind, group,
                                           dtype, block_size, head_dim):  # fmt: skip
    batch = paged_batch(VARIANT_BATCHES[kind], group * NUM_KV_HEADS, NUM_KV_HEADS, head_dim,
                        block_size, dtype)  # fmt: skip
    _check_variant(triton_ops, batch, _variant_args(VARIANTS[name], group * NUM_KV_HEADS),
                   tolerance)  # fmt: skip


# Splits over a window's key range: several splits inside it, unused ones past short ranges,
# the long launch's chunks split too; a window wider than the split length (40).
SPLIT_VARIANTS = {**VARIANTS, "window-40": dict(window=40)}


@pytest.mark.parametrize("name", SPLIT_VARIANTS)
def test_variants_with_splits(triton_ops, paged_batch, tolerance, name):
    i = list(SPLIT_VARIANTS).index(name)
    dtype, group = DTYPES[i % 2], (4, 1)[i // 2 % 2]
    batch = paged_batch([(130, 1), (90, 13), (6, 1), (70, 5)], group * NUM_KV_HEADS,
                        NUM_KV_HEADS, 32, 16, dtype, seed=i)  # fmt: skip
    _check_variant(triton_ops, batch, _variant_args(SPLIT_VARIANTS[name], group * NUM_KV_HEADS),
                   tolerance, num_splits=(3, 5)[i % 2], min_split_len=16)  # fmt: skip


@pytest.mark.parametrize("num_splits", [1, 3])
def test_variant_rows_without_keys_are_zero(triton_ops, paged_batch, tolerance, num_splits):
    # A padded entry of a captured batch (no key: seq_len 0) and a sequence with no queries:
    # the sink alone must not turn the empty row into NaN.
    batch = paged_batch([(0, 1), (40, 0), (70, 5), (20, 1)], 8, 2, 32, 16, torch.float32)
    args = dict(window=16, softcap=5.0, sinks=torch.linspace(-2.0, 4.0, 8, device=DEVICE))
    out = torch.full_like(batch.q, float("nan"))
    triton_ops.paged_attention(*batch.args(), out=out, **args, num_splits=num_splits,
                               min_split_len=16)  # fmt: skip
    assert (out[0] == 0).all()
    tol = tolerance[batch.q.dtype]
    torch.testing.assert_close(out, twins.paged_attention(*batch.args(), **args), atol=tol,
                               rtol=tol)  # fmt: skip


def test_window_wider_than_every_context_is_plain_attention(triton_ops, paged_batch):
    batch = paged_batch(VARIANT_BATCHES["mixed"], 8, 2, 32, 16, torch.float32)
    plain = triton_ops.paged_attention(*batch.args())
    torch.testing.assert_close(triton_ops.paged_attention(*batch.args(), window=1000), plain,
                               atol=0, rtol=0)  # fmt: skip


def test_window_splits_cover_only_its_keys(triton_ops, paged_batch, tolerance, device):
    from kernels import attention

    # Splits cut the window's key range (from the key tile of its start), not the whole
    # context: 300 keys would fill all 8 splits of 16; a window of 16 (plus the rounding down
    # to a 32-key tile) fills at most ceil((16 + 32) / 16) = 3, the rest are unused (lse -inf).
    batch = paged_batch([(300, 1)], 2, 2, 32, 16, torch.float32)
    partial, lse = attention.alloc_scratch(1, 2, 32, 8, device)
    lse.fill_(float("nan"))
    _check_variant(triton_ops, batch, dict(window=16), tolerance, num_splits=8, min_split_len=16,
                   scratch=(partial, lse))  # fmt: skip
    assert not lse.isnan().any(), "a split wrote no lse"
    assert (lse[:, :, :2] > float("-inf")).all() and (lse[:, :, 3:] == float("-inf")).all()
