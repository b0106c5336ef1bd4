"""An independent float64 reference for paged attention and its variants (window, softcap,
sinks), computed query by query from the dense keys of each sequence, and a helper that
poisons the blocks a windowed batch must never read.

Shared by the twin's, the CPU kernels' and the Triton kernel's variant tests.
"""

from __future__ import annotations

import math

import torch

from tests.kernels.conftest import PagedBatch


def reference_attention(batch: PagedBatch, *, window: int = 0, softcap: float = 0.0,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """[num_tokens, num_heads, head_dim] float64, one query row at a time."""
    q = batch.q.double()
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = batch.k_cache.shape[1], batch.k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros((num_tokens, num_heads, head_dim), dtype=torch.float64)
    starts = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        q_len = starts[i + 1] - starts[i]
        table = batch.block_tables[i].long()
        for j in range(q_len):
            pos = seq_len - q_len + j
            lo = max(0, pos - window + 1) if window else 0
            keys = range(lo, pos + 1)
            blocks = table[[p // block_size for p in keys]]
            offsets = torch.tensor([p % block_size for p in keys])
            k = batch.k_cache[blocks, offsets].double()  # [n, num_kv_heads, head_dim]
            v = batch.v_cache[blocks, offsets].double()
            for h in range(num_heads):
                s = (k[:, h // group] @ q[starts[i] + j, h]) * batch.scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                top = s.max().item()
                if sinks is not None:
                    top = max(top, float(sinks[h]))
                w = torch.exp(s - top)
                denom = w.sum() + (math.exp(float(sinks[h]) - top) if sinks is not None else 0.0)
                out[starts[i] + j, h] = (w[:, None] * v[:, h // group]).sum(0) / denom
    return out


def poison_outside_windows(batch: PagedBatch, window: int) -> int:
    """Fill with NaN every block of a sequence that lies wholly below its first query's window,
    as a block freed by the block manager and reused may hold anything. Returns how many."""
    block_size = batch.k_cache.shape[1]
    starts = batch.query_start_loc.tolist()
    poisoned = 0
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        q_len = starts[i + 1] - starts[i]
        first_visible = max(0, seq_len - q_len - window + 1)
        for b in range(first_visible // block_size):
            block = int(batch.block_tables[i, b])
            batch.k_cache[block] = float("nan")
            batch.v_cache[block] = float("nan")
            poisoned += 1
    return poisoned
