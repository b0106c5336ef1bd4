"""The CUDA-only code paths of the executor's host<->device traffic: pinned staging with async
copies in the swap pool, and step inputs sent in one pinned, non-blocking copy. The CPU runs of
the same code are the oracle."""

from __future__ import annotations

import pytest
import torch

from executor_svc.inputs import build_inputs
from executor_svc.kv_cache import KVCache
from executor_svc.swap import SwapPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


def test_swap_round_trip_through_pinned_staging():
    gen = torch.Generator().manual_seed(0)
    shape = (64, 16, 8, 128)  # [num_blocks, block_size, num_kv_heads, head_dim]
    host_k = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(4)]
    host_v = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(4)]
    kv = KVCache([t.to(CUDA, copy=True) for t in host_k], [t.to(CUDA, copy=True) for t in host_v])
    pool = SwapPool.allocate(kv, num_blocks=40)
    assert pool.pin_staging and pool.k_caches[0].device.type == "cpu"
    out_pairs = [(d, c) for c, d in enumerate(range(3, 63, 2))]  # 30 blocks
    pool.swap_out(kv, out_pairs)
    # Overwrite the device blocks at once (stream-ordered after the copies), then bring the
    # blocks back shifted by one, several rounds, reusing the staging memory each time.
    for t in (*kv.k_caches, *kv.v_caches):
        t.zero_()
    in_pairs = [(c, d + 1) for d, c in out_pairs]
    for _ in range(3):
        pool.swap_in(kv, in_pairs)
    torch.cuda.synchronize()
    for dev, swapped, host in zip((*kv.k_caches, *kv.v_caches),
                                  (*pool.k_caches, *pool.v_caches), (*host_k, *host_v),
                                  strict=True):
        for d, c in out_pairs:
            assert torch.equal(swapped[c], host[d]) and torch.equal(dev[d + 1].cpu(), host[d])
        moved = {d + 1 for d, _ in out_pairs}
        assert (dev[[b for b in range(64) if b not in moved]] == 0).all()


def test_step_inputs_on_cuda_equal_the_cpu_build():
    token_chunks = [[5, 6, 7], [9], list(range(100, 140))]
    block_rows = [[3, 1], [7, 8, 9], list(range(20, 31))]
    args = (block_rows, [2, 10, 0], [3, 1, 40], [5, 11, 44], 4)  # the last one does not sample
    cpu = build_inputs(token_chunks, *args, torch.device("cpu"))
    gpu = build_inputs(token_chunks, *args, CUDA)
    for a, b in zip(cpu[:2], gpu[:2], strict=True):
        assert b.is_cuda and torch.equal(a, b.cpu())
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc", "logits_indices"):
        a, b = getattr(cpu[2], name), getattr(gpu[2], name)
        assert b.is_cuda and a.dtype == b.dtype and torch.equal(a, b.cpu()), name
    assert (cpu[3] == gpu[3]).all()
