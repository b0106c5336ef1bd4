"""paged_attention: the Triton kernel against its torch twin (interpreted on CPU, compiled on GPU).

Every batch uses shuffled physical blocks, ragged lengths crossing block boundaries, NaN in every
cache slot it must not read, and a NaN-poisoned output so an unwritten element shows.
"""

import itertools

import pytest
import torch

from kernels import twins

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
