"""paged_attention's launch plan and device-side split-KV, against the twin and an independent
float64 reference (interpreted on CPU, compiled on GPU).

Decode rows of a mixed batch run in the short launch's 16-row tiles, the prefill chunks in the
long launch's wide tiles; the split count and boundaries follow each tile's key range on the
device, so lengths on both sides of split and tile boundaries, and a scratch buffer reused
across steps of changing lengths (what a captured graph replays), must all stay exact.
"""

import pytest
import torch

from kernels import twins
from tests.kernels.conftest import DEVICE

TOL64 = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# Triton 3.9's interpreter computes tl.dot on bf16 operands wrongly (off by ~1e10 on a 16x16
# product), so bf16 runs only compiled, on CUDA.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def reference64(batch) -> torch.Tensor:
    """Dense causal attention in float64, straight from the cache through the block table."""
    q = batch.q.double()
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = batch.k_cache.shape[1], batch.k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    starts, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        pos = torch.arange(seq_len)
        blocks = batch.block_tables[i].long()[pos // block_size]
        k = batch.k_cache[blocks, pos % block_size].double()  # [seq_len, Hkv, D]
        v = batch.v_cache[blocks, pos % block_size].double()
        for t in range(starts[i], starts[i + 1]):
            q_pos = seq_len - (starts[i + 1] - starts[i]) + (t - starts[i])
            for h in range(num_heads):
                scores = k[: q_pos + 1, h // group] @ q[t, h] * batch.scale
                out[t, h] = torch.softmax(scores, 0) @ v[: q_pos + 1, h // group]
    return out


def _run(triton_ops, batch, **kwargs) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    assert triton_ops.paged_attention(*batch.args(), out=out, **kwargs) is out
    assert not out.isnan().any(), "unwritten or poisoned-read elements in the output"
    return out


def _check_both(triton_ops, batch, **kwargs) -> None:
    out = _run(triton_ops, batch, **kwargs).float()
    tol = TOL64[batch.q.dtype]
    expected = twins.paged_attention(*batch.args()).float()
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(out.double(), reference64(batch), atol=tol, rtol=tol)


@pytest.mark.parametrize("group", [1, 4, 8, 32])
def test_decode_rows_of_mixed_batches_get_16_row_tiles(group):
    pytest.importorskip("triton")
    from kernels import attention

    for dtype in (torch.bfloat16, torch.float32):
        launches = attention.plan_launches(dtype, 2 * group, 2, 128, 2100, 40, 2048)
        (short, short_blocks), (long, long_blocks) = launches
        assert short["BLOCK_M"] == max(16, group) and short_blocks == 40
        assert long["BLOCK_M"] >= short["BLOCK_M"] and long_blocks == 2100 // long["BLOCK_Q"] + 40
        # A decode-only step (what CUDA graphs capture) is one launch of short tiles.
        assert len(attention.plan_launches(dtype, 2 * group, 2, 128, 40, 40, 1)) == 1


MIXED = [(23, 23), (33, 1), (70, 13), (9, 1), (40, 8), (100, 3), (17, 17), (130, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batches(triton_ops, paged_batch, dtype, head_dim, group):
    # Decodes, short chunks that fit a 16-row tile (q_len 2, 3 with small groups) and prefill
    # chunks longer than one wide tile's queries, shuffled through the batch.
    batch = paged_batch(MIXED, 2 * group, 2, head_dim, 16, dtype)
    _check_both(triton_ops, batch)


def _straddling_lengths(min_split_len: int) -> list[int]:
    edges = [min_split_len, 2 * min_split_len, 3 * min_split_len]
    return [1] + [e + d for e in edges for d in (-1, 0, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_splits", [2, 3, 4])
def test_device_splits_straddle_boundaries(triton_ops, paged_batch, dtype, max_splits):
    # min_split_len 64 puts split edges at multiples of 64 keys (key tiles are 32 or 64): each
    # length sits one below, on, or one above an edge, so tiles and splits end part-full,
    # exactly full, or with a single key.
    seqs = [(n, 1) for n in _straddling_lengths(64)]
    batch = paged_batch(seqs, 8, 2, 64, 16, dtype)
    _check_both(triton_ops, batch, num_splits=max_splits, min_split_len=64)


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_splits_in_mixed_batches_and_block_sizes(triton_ops, paged_batch, block_size):
    # Chunks split too; block sizes below, at and above the key tile (one block id per tile).
    seqs = [(193, 7), (64, 1), (129, 1), (65, 20), (200, 1)]
    batch = paged_batch(seqs, 8, 2, 128, block_size, torch.float16)
    _check_both(triton_ops, batch, num_splits=3, min_split_len=64)


def test_scratch_is_reused_across_steps_of_changing_lengths(triton_ops, paged_batch, device):
    from kernels import attention

    # Scratch sized once for more rows and splits than any step uses, poisoned: an unused
    # split's partial output is never read, only its lse = -inf is.
    partial, lse = attention.alloc_scratch(16, 8, 64, 6, device)
    partial.fill_(float("nan"))
    lse.fill_(float("nan"))
    for step, lengths in enumerate([(60, 130, 5), (61, 131, 6), (200, 1, 64), (129, 260, 7)]):
        batch = paged_batch([(n, 1) for n in lengths], 8, 2, 64, 16, torch.float32, seed=step)
        batch.max_seq_len = 1  # unused: splits follow the lengths on the device
        _check_both(triton_ops, batch, num_splits=4, min_split_len=64, scratch=(partial, lse))


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(14, 2, 64), (6, 3, 96)])
def test_odd_groups_with_splits(triton_ops, paged_batch, num_heads, num_kv_heads, head_dim):
    batch = paged_batch(MIXED, num_heads, num_kv_heads, head_dim, 16, torch.float32)
    _check_both(triton_ops, batch, num_splits=3, min_split_len=32)
