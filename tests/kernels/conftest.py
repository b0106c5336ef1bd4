"""Kernel test setup: where the Triton launchers run, and paged batches to feed them.

Without CUDA the launchers run in Triton's interpreter on CPU tensors; that must be switched on
before any kernel module is imported, hence the environment write at import time. With CUDA the
same default tests run compiled on the GPU (small shapes, fp32/fp16); `gpu` tests add bf16 and
realistic sizes.
"""

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# fp32 agrees with the twins to rounding; fp16 differs by the P@V operand rounding.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass
class PagedBatch:
    """A varlen batch over a paged cache whose unused slots hold NaN (poison)."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    scale: float

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.max_query_len, self.max_seq_len, self.scale)  # fmt: skip


def fused_qkv_views(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype):
    """(qkv, q, k, v) as the model hands them to rotary: q [num_tokens, num_heads, head_dim]
    and k [num_tokens, num_kv_heads, head_dim] strided views into one random fused qkv row."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    return (qkv, q.view(num_tokens, num_heads, head_dim),
            k.view(num_tokens, num_kv_heads, head_dim), v)


def make_paged_batch(
    seqs: list[tuple[int, int]],  # (seq_len including new tokens, q_len) per sequence
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device = DEVICE,
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Fill each sequence's context at randomly shuffled physical blocks; the rest stays NaN."""
    gen = torch.Generator(device).manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for seq_len, _ in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max(blocks_per_seq) + 1  # a spare column: tables are wider than needed
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    physical = torch.randperm(num_blocks, generator=gen, device=device).int()
    # Unused table entries point at a block of poison, so a read past seq_len shows as NaN.
    block_tables = physical[-1].repeat(len(seqs), max_blocks)  # [num_seqs, max_blocks]
    used = 0
    for i, (seq_len, _) in enumerate(seqs):
        n = blocks_per_seq[i]
        block_tables[i, :n] = physical[used : used + n]
        used += n
        ids = block_tables[i, :n].long()
        pos = torch.arange(seq_len, device=device)
        for cache in (k_cache, v_cache):
            values = torch.randn((seq_len, num_kv_heads, head_dim), generator=gen, device=device)
            cache[ids[pos // block_size], pos % block_size] = values.to(dtype)
    q_lens = torch.tensor([q_len for _, q_len in seqs])
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = q_lens.cumsum(0)
    q = torch.randn((int(q_lens.sum()), num_heads, head_dim), generator=gen, device=device)
    return PagedBatch(
        q=q.to(dtype), k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device),
        max_query_len=int(q_lens.max()), max_seq_len=max(s for s, _ in seqs),
        scale=head_dim**-0.5,
    )  # fmt: skip


@pytest.fixture
def triton_ops():
    """The Triton launchers (interpreted on CPU); skips where triton is not installed."""
    pytest.importorskip("triton")
    from kernels import triton_ops

    return triton_ops


@pytest.fixture
def paged_batch():
    """Factory: make_paged_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype)."""
    return make_paged_batch


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def tolerance() -> dict[torch.dtype, float]:
    return TOLERANCE
